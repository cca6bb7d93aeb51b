"""`mega-async launch slurm`: one sbatch job from the allocation (plan.py decides the nodes, fit.py checks the
model fits, render.py writes the script from launch/slurm/, slurm.py validates and submits)."""
