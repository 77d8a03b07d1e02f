"""The course's Databricks job: a summary of every lesson's status, written by the job's last task.

``databricks.yml`` runs one task per notebook, each after the previous one with ``run_if: ALL_DONE``
(a failed lesson does not skip the later ones on a cluster you are paying for), and a last task that
runs ``clusters/job_summary.py``: it reads the run's task states with the Databricks SDK and prints
this summary (and fails, so the run is marked failed, when a lesson failed). It authenticates with
``workspace_client``: the task's ``DATABRICKS_HOST``/``DATABRICKS_TOKEN``, else the notebook context's, else
the runtime's credentials; when none works it says which fix to make.

    from dtlab.tooling import jobs
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


class JobsError(RuntimeError):
    """The summary task cannot reach the workspace; the message names the fix."""


def workspace_client():
    """A ``databricks.sdk.WorkspaceClient`` that authenticates in a job's task, trying in order:

    1. ``DATABRICKS_HOST`` and ``DATABRICKS_TOKEN`` (the job's ``spark_env_vars``, the token from a secret scope);
    2. the notebook's context, ``apiUrl`` and ``apiToken`` (present in notebook tasks of job runs; see
       ``dtlab.tracking.databricks_credentials``);
    3. the runtime's own credentials, asked for by name (``auth_type="runtime"``): the SDK's default chain
       tries other methods first and, on some job clusters, fails or builds a host of ``https://None``
       (databricks-sdk-py issues 202, 317).

    Raises:
        JobsError: none of them works, naming the fix.
    """
    from databricks.sdk import WorkspaceClient

    from dtlab import tracking

    try:
        host, token = tracking.databricks_credentials()
    except tracking.TrackingError:
        host = token = None
    try:
        if host and token:
            return WorkspaceClient(host=host, token=token)
        return WorkspaceClient(auth_type="runtime")
    except Exception as err:   # the SDK's ValueError: "cannot configure default credentials", ...
        raise JobsError(f"the job summary cannot authenticate to the workspace ({str(err).splitlines()[0]}). Fix: "
                        "run it as a task of the course's job on Databricks, or give the task DATABRICKS_HOST and "
                        "DATABRICKS_TOKEN (spark_env_vars, the token from a secret scope: "
                        "\"{{secrets/<scope>/<key>}}\")") from None


def run_states(run_id: int, skip: str = "job_summary", client: Any = None) -> list[dict[str, Any]]:
    """The states of a job run's tasks (all but ``skip``), read with the Databricks SDK (``workspace_client``)."""
    client = client or workspace_client()
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
    try:
        states = run_states(int(args[0]))
    except JobsError as err:
        print(f"job_summary: {err}", file=sys.stderr)
        return 2
    print(summary(states))
    return 0 if states and all(s["result_state"] == "SUCCESS" for s in states) else 1
