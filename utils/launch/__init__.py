"""The launchers run_*.sh as Python: options (options.py), the machine and the plan of runs (plan.py), running them
(run.py). Standard library only, with any Python 3: torch is imported by the probe alone, in the training
environment's Python (scripts/python_env.sh finds or makes it), so --help, option errors and dry runs stay fast."""
