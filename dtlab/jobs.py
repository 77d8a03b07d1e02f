"""The course's Databricks job: a summary of every lesson's status, written by the job's last task.

``databricks.yml`` runs one task per notebook, each after the previous one with ``run_if: ALL_DONE``
(a failed lesson does not skip the later ones on a cluster you are paying for), and a last task that
runs ``clusters/job_summary.py``: it reads the run's task states with the Databricks SDK and prints
this summary (and fails, so the run is marked failed, when a lesson failed).

    from dtlab import jobs
    print(jobs.summary([{"task_key": "nb00_environment", "result_state": "SUCCESS"}, ...]))
"""

from __future__ import annotations

from typing import Any


def summary(states: list[dict[str, Any]]) -> str:
    """A Markdown table of ``states`` (dicts with ``task_key``, ``result_state`` and optionally
    ``error`` and ``seconds``) and a last line counting the lessons that succeeded."""
    rows = ["| lesson | state | seconds | error |", "|---|---|---:|---|"]
    for s in states:
        error = str(s.get("error") or "").replace("|", "\\|").splitlines()
        seconds = s.get("seconds")
        rows.append(f"| {s['task_key']} | {s.get('result_state') or 'NOT RUN'} | "
                    f"{'' if seconds is None else f'{seconds:.0f}'} | {error[0][:200] if error else ''} |")
    ok = sum(s.get("result_state") == "SUCCESS" for s in states)
    rows.append(f"\n{ok}/{len(states)} lessons succeeded")
    return "\n".join(rows)


def run_states(run_id: int, skip: str = "job_summary") -> list[dict[str, Any]]:
    """The states of a job run's tasks (all but ``skip``), read with the Databricks SDK (preinstalled on
    Databricks; it authenticates from the cluster)."""
    from databricks.sdk import WorkspaceClient

    client = WorkspaceClient()
    run = client.jobs.get_run(run_id)
    states = []
    for task in sorted(run.tasks or [], key=lambda t: t.start_time or 0):
        if task.task_key == skip:
            continue
        state = task.state
        result = getattr(getattr(state, "result_state", None), "value", None) or \
            getattr(getattr(state, "life_cycle_state", None), "value", None)
        seconds = (task.end_time - task.start_time) / 1000 if task.end_time and task.start_time else None
        states.append({"task_key": task.task_key, "result_state": result, "seconds": seconds,
                       "error": getattr(state, "state_message", "") or ""})
    return states


def main(argv: list[str] | None = None) -> int:
    """Entry of the job's summary task: ``job_summary.py <run id>``; exit 1 when a lesson failed."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args or not args[0].isdigit():
        print("usage: job_summary.py <job run id>  (databricks.yml passes {{job.run_id}})", file=sys.stderr)
        return 2
    states = run_states(int(args[0]))
    print(summary(states))
    return 0 if states and all(s["result_state"] == "SUCCESS" for s in states) else 1
