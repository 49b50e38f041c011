"""``asyncrl slurm`` without a cluster: the placement's checks and layout, the batch script it
writes, and the step wrapper each service starts through (the real-Slurm runs are
tests/deploy/test_slurm_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.config import load_config
from launcher.slurm.placement import PlacementError, place, requirements
from launcher.slurm.steps import engine_command

REPO = Path(__file__).resolve().parents[2]
GPU_RUN = ["engines.backend=sglang", "trainer.device=cuda", "slurm.gpus_per_node=8"]


def cfg(*overrides: str):
    return load_config(None, list(overrides), environ={})


def test_a_gpu_placement_splits_nodes_and_gpus():
    c = cfg(*GPU_RUN, "trainer.nnodes=2", "trainer.nproc_per_node=8", "slurm.engine_nodes=2", "slurm.engines_per_node=4",
            "engines.gpus_per_engine=2")
    need = requirements(c)
    assert (need.nodes, need.gpus_per_node, need.engines) == (4, 8, 8)
    p = place(c, ["n1", "n2", "n3", "n4"])
    assert p.batch_host == "n1" and p.trainer_hosts == ("n1", "n2") and p.trainer_gpus == tuple(range(8))
    assert [(e.host, e.gpus) for e in p.engines[:4]] == [("n3", (0, 1)), ("n3", (2, 3)), ("n3", (4, 5)), ("n3", (6, 7))]
    assert {e.host for e in p.engines[4:]} == {"n4"} and [e.index for e in p.engines] == list(range(8))


def test_one_node_shared_by_the_trainer_and_the_engines():
    c = cfg(*GPU_RUN, "trainer.nproc_per_node=4", "slurm.engines_per_node=2", "engines.gpus_per_engine=2")
    p = place(c, ["gpu7"])
    assert p.trainer_gpus == (0, 1, 2, 3) and [e.gpus for e in p.engines] == [(4, 5), (6, 7)]
    cpu = place(cfg(), ["vm"])  # the CPU run: everything on the batch host, no GPU anywhere
    assert cpu.trainer_hosts == ("vm",) and [(e.host, e.gpus) for e in cpu.engines] == [("vm", ())]


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.nnodes=2", "slurm.nodes=1"],
     "slurm.nodes=1 but the placement needs 2 nodes (trainer.nnodes=2 + slurm.engine_nodes=0)"),
    ([*GPU_RUN, "trainer.nproc_per_node=8", "slurm.engines_per_node=1"],
     "slurm.gpus_per_node=8 but the placement needs 9 GPUs per node (trainer.nproc_per_node=8 + slurm.engines_per_node=1 "
     "x engines.gpus_per_engine=1 on the trainer's first node)"),
    ([*GPU_RUN, "slurm.engine_nodes=1", "slurm.engines_per_node=3", "engines.gpus_per_engine=4"],
     "slurm.gpus_per_node=8 but the placement needs 12 GPUs per node (slurm.engines_per_node=3 x engines.gpus_per_engine=4 "
     "on each engine node)"),
    (["trainer.device=cuda"], "trainer.device=cuda but slurm.gpus_per_node=0"),
    (["slurm.gpus_per_node=4"], "engines.backend=local runs on CPUs"),
    (["engines.urls=[\"http://e:1\"]"], "engines.urls is set"),
])
def test_a_placement_the_allocation_cannot_hold_is_refused_naming_both_numbers(overrides, message):
    with pytest.raises(PlacementError) as err:
        requirements(cfg(*overrides))
    assert message in str(err.value)


def test_the_real_allocation_is_checked_too():
    with pytest.raises(PlacementError, match=r"the allocation has 1 nodes \(n1\) but the placement needs 2"):
        place(cfg("trainer.nnodes=2"), ["n1"])


def test_the_script_carries_the_slurm_section_and_runs_the_driver(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launcher", "slurm", f"run.dir={run_dir}", *GPU_RUN, "trainer.nproc_per_node=8",
            "slurm.engine_nodes=1", "slurm.engines_per_node=8", "slurm.partition=h100", "slurm.account=rl", "slurm.time=04:00:00",
            "slurm.container_image=nvcr.io#nvidia/pytorch:25.01-py3", 'slurm.extra_sbatch=["--constraint=ib"]',
            'slurm.setup=["module load cuda"]', "security.admin_token=an-admin-token-of-some-length-0123"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    sbatch = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=asyncrl-demo", "--nodes=2", "--ntasks-per-node=1", f"--output={run_dir}/logs/slurm-%j.out",
                      "--open-mode=append", "--gpus-per-node=8", "--partition=h100", "--account=rl", "--time=04:00:00",
                      "--requeue", "--signal=B:USR1@300", "--constraint=ib"]
    body = script.split("#SBATCH --constraint=ib\n", 1)[1].splitlines()
    assert body[:2] == ["set -euo pipefail", "module load cuda"]
    assert body[-1] == f"exec python3 -m launcher slurm-job {run_dir}/slurm/run.yaml"  # in a container: its python3
    run_file = run_dir / "slurm" / "run.yaml"
    assert run_file.stat().st_mode & 0o077 == 0
    assert yaml.safe_load(run_file.read_text())["security"]["admin_token"] == "an-admin-token-of-some-length-0123"
    assert "--submit" not in out.stdout and f"sbatch {run_dir}/slurm/job.sbatch" in out.stdout


def test_submit_without_sbatch_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launcher", "slurm", f"run.dir={tmp_path / 'run'}", "--submit"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "PATH": str(tmp_path)})
    assert out.returncode == 1 and "sbatch not found" in out.stderr


def _step(tmp_path: Path, *opts: str, env: dict | None = None) -> dict:
    """Run the step wrapper with a command that prints what it got."""
    probe = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'rank': os.environ.get('RANK_VAR')}))"
    out = subprocess.run([sys.executable, "-m", "launcher.slurm.step", *opts, "--", sys.executable, "-c", probe, "--port", "{port}"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_step_wrapper_slices_gpus_picks_a_port_and_passes_the_node_rank(tmp_path):
    endpoint = tmp_path / "e.json"
    got = _step(tmp_path, "--gpus=2,3", f"--endpoint={endpoint}", "--node-rank-env=RANK_VAR",
                env={"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d", "SLURM_NODEID": "1"})
    port = json.loads(endpoint.read_text())["port"]
    assert got == {"argv": ["--port", str(port)], "cuda": "GPU-c,GPU-d", "rank": "1"} and port > 0
    again = _step(tmp_path, f"--endpoint={endpoint}", f"--port={port}", "--gpus=")
    assert again["argv"] == ["--port", str(port)] and again["cuda"] == ""  # a restart keeps its port; no GPU for a CPU step


def test_the_step_wrapper_refuses_gpus_the_step_does_not_have(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launcher.slurm.step", "--gpus=4", "--", "true"], capture_output=True, text=True,
                         cwd=REPO, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert out.returncode != 0 and "GPUs [4] asked for, but the step sees only 2" in out.stderr


def test_the_batch_hosts_ports_are_distinct():
    from asyncrl.listen_ports import distinct_free_ports

    ports = distinct_free_ports(64)
    assert len(set(ports)) == 64 and all(p > 0 for p in ports)


def test_the_engine_key_reaches_sglang_in_a_private_config_file_not_the_command_line(tmp_path):
    """SGLang takes its API key as a flag or from ``--config`` (YAML): the step writes it to a
    0600 file, so the node's other users cannot read it from the process's command line."""
    probe = ("import json, os, stat, sys; path = sys.argv[sys.argv.index('--config') + 1]; "
             "print(json.dumps({'argv': sys.argv[1:], 'file': open(path).read(), 'mode': stat.S_IMODE(os.stat(path).st_mode), "
             "'dir_mode': stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode), 'env': os.environ.get('KEY_VAR')}))")
    out = subprocess.run([sys.executable, "-m", "launcher.slurm.step", "--secret-config=api-key=KEY_VAR", "--",
                          sys.executable, "-c", probe, "--port", "1"], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "KEY_VAR": "s3cr3t-key-0123456789", "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert "s3cr3t-key-0123456789" not in " ".join(got["argv"]) and got["argv"][:2] == ["--port", "1"]
    assert yaml.safe_load(got["file"]) == {"api-key": "s3cr3t-key-0123456789"}
    assert got["mode"] == 0o600 and got["dir_mode"] == 0o700 and got["env"] is None
    cmd, env, opts = engine_command(
        load_config(None, ["engines.backend=sglang", "engines.api_key=another-key-0123456789"], environ={}), "python3")
    assert "another-key-0123456789" not in cmd and opts == ["--secret-config=api-key=ASYNCRL_ENGINE_API_KEY"]
    assert env["ASYNCRL_ENGINE_API_KEY"] == "another-key-0123456789" and cmd[:3] == ["python3", "-m", "sglang.launch_server"]


def test_sglang_engines_get_the_weight_group_timeout_through_asyncrls_hook():
    """Issue 66 N7: the job's SGLang engines load ``launcher/sglang_hooks`` first (then whatever
    ``PYTHONPATH`` the job had) with ``engines.weight_group_timeout_s``; a timeout the engines
    could hit in a healthy sync is refused at load."""
    from launcher.sglang_hooks import HOOK_DIR, TIMEOUT_ENV

    cfg = load_config(None, ["engines.backend=sglang", "engines.weight_group_timeout_s=450"], environ={})
    _, env, _ = engine_command(cfg, "python3")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(HOOK_DIR) and (HOOK_DIR / "sitecustomize.py").is_file()
    assert env[TIMEOUT_ENV] == "450"
    with pytest.raises(ValueError, match=r"engines.weight_group_timeout_s \(300\) must exceed sync.broadcast_timeout_s \(300\)"):
        load_config(None, ["engines.weight_group_timeout_s=300"], environ={})


def test_routing_replay_starts_sglang_with_its_routes_returned():
    """Issue 66 N3: with ``actor.router_replay.mode = "R3"`` the job's SGLang engines must answer
    routed experts (``--enable-return-routed-experts``; without it every call of the run is an
    engine error); once, also when ``slurm.sglang_args`` names it; not without R3."""
    r3 = ["engines.backend=sglang", "actor.router_replay.mode=R3"]
    cmd, _, _ = engine_command(load_config(None, r3, environ={}), "python3")
    assert cmd.count("--enable-return-routed-experts") == 1
    cmd, _, _ = engine_command(load_config(None, [*r3, 'slurm.sglang_args=["--enable-return-routed-experts"]'], environ={}),
                               "python3")
    assert cmd.count("--enable-return-routed-experts") == 1
    cmd, _, _ = engine_command(load_config(None, ["engines.backend=sglang"], environ={}), "python3")
    assert "--enable-return-routed-experts" not in cmd


def test_in_place_pauses_start_sglang_without_the_prefix_cache_and_the_overlap_scheduler():
    """Issue 66 N1, N2: ``in_place`` (and per_request with in_place survivors) needs
    ``--disable-radix-cache --disable-overlap-schedule`` on every engine, or the sync agent
    refuses them; the job's SGLang command has both exactly then, the local engines' flags too."""
    flags = ["--disable-radix-cache", "--disable-overlap-schedule"]
    base = ["engines.backend=sglang", "async_training.partial_rollout=true"]
    for extra, wanted in ((["sync.pause_policy=in_place"], True), (["sync.pause_policy=per_request"], True),
                          (["sync.pause_policy=per_request", "sync.per_request.survivor_mode=retract"], False),
                          (["sync.pause_policy=abort"], False), (["sync.pause_policy=retract"], False)):
        cmd, _, _ = engine_command(load_config(None, [*base, *extra], environ={}), "python3")
        assert [cmd.count(f) for f in flags] == ([1, 1] if wanted else [0, 0]), extra
        local, _, _ = engine_command(load_config(None, ["async_training.partial_rollout=true", *extra], environ={}), "python3")
        assert [local.count(f) for f in flags] == ([1, 1] if wanted else [0, 0]), extra
    cmd, _, _ = engine_command(load_config(None, [*base, "sync.pause_policy=in_place",
                                                  'slurm.sglang_args=["--disable-radix-cache"]'], environ={}), "python3")
    assert [cmd.count(f) for f in flags] == [1, 1]
