"""Starting a run's processes: `local` (the trainer ranks on one host, torchrun) and `slurm` (one sbatch job from
the allocation: plan the nodes, check the model fits, render the script from the templates shipped here, submit).
"""
