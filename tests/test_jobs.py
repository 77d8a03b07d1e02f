"""dtlab.tooling.jobs, the course job's summary task: its table, its login and its reading of a run through the
Databricks SDK (against tests/jobs_api.py's Jobs API on 127.0.0.1). tests/runtime runs clusters/job_summary.py
itself on the runtime's SDK."""

import sys
from pathlib import Path

import pytest

from dtlab.tooling import jobs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jobs_api import JobsAPI  # noqa: E402

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


RUN = {"run_id": 7, "tasks": [
    {"task_key": "nb01_single_device_baseline", "start_time": 62000, "end_time": 92000,
     "state": {"life_cycle_state": "TERMINATED", "result_state": "FAILED", "state_message": "cell 7: a | b"}},
    {"task_key": "nb00_environment", "start_time": 1000, "end_time": 61000,
     "state": {"life_cycle_state": "TERMINATED", "result_state": "SUCCESS"}},
    {"task_key": "nb02_collectives", "state": {"life_cycle_state": "SKIPPED"}},
    {"task_key": "job_summary", "start_time": 93000, "state": {"life_cycle_state": "RUNNING"}}]}


@pytest.fixture
def no_credentials(monkeypatch):
    for name in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "DATABRICKS_RUNTIME_VERSION", "DATABRICKS_CONFIG_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DATABRICKS_CONFIG_FILE", "/nonexistent/.databrickscfg")


def test_the_summary_reads_a_run_in_order_through_the_sdk(no_credentials, monkeypatch):
    api = JobsAPI("dapi-secret", RUN)
    monkeypatch.setenv("DATABRICKS_HOST", api.url)
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-secret")
    try:
        states = jobs.run_states(7)
    finally:
        api.close()
    assert [s["task_key"] for s in states] == ["nb02_collectives", "nb00_environment", "nb01_single_device_baseline"]
    assert [s["result_state"] for s in states] == ["SKIPPED", "SUCCESS", "FAILED"]
    assert states[1]["seconds"] == 60 and states[2]["error"] == "cell 7: a | b"
    table = jobs.summary(states)
    assert "cell 7: a \\| b" in table and table.endswith("1/3 lessons succeeded")


def test_a_wrong_token_is_an_error_not_an_empty_summary(no_credentials, monkeypatch):
    api = JobsAPI("dapi-secret", RUN)
    monkeypatch.setenv("DATABRICKS_HOST", api.url)
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-wrong")
    try:
        with pytest.raises(Exception, match="(?i)invalid access token|unauthenticated"):
            jobs.run_states(7)
    finally:
        api.close()


def test_without_credentials_the_summary_exits_2_naming_the_fix(no_credentials, capsys):
    assert jobs.main(["7"]) == 2
    err = capsys.readouterr().err
    assert "DATABRICKS_HOST" in err and "{{secrets/" in err
    assert jobs.main([]) == 2 and "usage" in capsys.readouterr().err
