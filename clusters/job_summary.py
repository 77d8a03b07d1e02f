"""The course job's last task: every lesson's status in one table (see dtlab.tooling.jobs).

databricks.yml runs it with `run_if: ALL_DONE` and the parameter {{job.run_id}}.
"""
import sys

from dtlab.tooling import jobs

sys.exit(jobs.main())
