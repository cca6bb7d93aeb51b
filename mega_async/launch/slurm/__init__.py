"""`mega-async launch slurm`: one sbatch job from the allocation (plan.py decides the nodes, fit.py checks the
model fits, render.py writes the script from templates/, submit.py validates and submits)."""
