"""The serverless job's task: the lessons that need no cluster, run headless one after another.

databricks.yml's job ``dtlab_serverless`` runs this file on serverless compute, in the job's environment
``dtlab`` (the bundle's dtlab wheel, torch and the notebook runner). A notebook task there would take its
libraries from the notebook's own Environment panel, not from the job; a Python task takes the job's
environment, so this task runs the lessons as ``dtlab course run`` does on a laptop: each in its own Jupyter
kernel, CPU processes with gloo, every claim checked. Its parameters are ``dtlab course run``'s:

    --notebooks <the deployed notebooks folder> --runs <where executed copies go> 00_environment 01_... ...

It fails (exit status 1) when any lesson fails, after running the rest; the log ends with each lesson's status.
Run it on your machine the same way: ``python clusters/serverless_lessons.py --notebooks notebooks 00``.
"""
import sys
from pathlib import Path

# Python puts this file's folder first on sys.path, and clusters/ holds folders named horovod and deepspeed (launch
# templates): `import horovod` would find one of them instead of the package (or its absence).
here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]

from dtlab.tooling.cli import main  # noqa: E402

status = main(["course", "run", "--quiet", *sys.argv[1:]])
if status:  # a Python task fails on a non-zero exit; exiting 0 explicitly is not needed
    sys.exit(status)
