"""The lock files (issue 30 item 7): every package the install takes is pinned to one version with
the hashes of its files, the locks satisfy pyproject.toml, and this environment (made by
``./dev install``) holds exactly what ``constraints/dev.lock`` says.

``./dev lock`` writes the locks (pip-compile over PyPI); nothing here needs the network.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "constraints"
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\s*--hash=sha256:[0-9a-f]{64})*)", re.M)


def read_lock(name: str) -> dict[str, tuple[str, list[str]]]:
    """``{canonical name: (version, [sha256, ...])}``; a requirement line of any other form fails."""
    text = (CONSTRAINTS / name).read_text()
    out = {}
    for m in ENTRY.finditer(text):
        out[canonicalize_name(m.group(1))] = (m.group(2), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    stray = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", "--hash"))
             and not ENTRY.match(ln)]
    assert not stray, f"{name}: lines that are not 'name==version \\' pins: {stray[:5]}"
    return out


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


@pytest.mark.parametrize("lock", ["dev.lock", "runtime.lock", "torch-cpu.lock"])
def test_every_entry_is_one_version_with_hashes(lock):
    entries = read_lock(lock)
    assert entries
    for name, (version, hashes) in entries.items():
        Version(version)  # a single exact version
        assert hashes, f"{lock}: {name}=={version} has no --hash"


def test_the_locks_satisfy_pyproject_and_agree():
    dev, runtime = read_lock("dev.lock"), read_lock("runtime.lock")
    deps = [Requirement(r) for r in project()["dependencies"]]
    extras = [Requirement(r) for r in project()["optional-dependencies"]["dev"]]
    for lock, reqs in (("runtime.lock", deps), ("dev.lock", deps + extras)):
        entries = runtime if lock == "runtime.lock" else dev
        for req in filter(applies, reqs):
            name = canonicalize_name(req.name)
            if name == "torch":
                continue  # the platform's choice: torch-cpu.lock or the GPU machine's own build
            assert name in entries, f"{lock} lacks {req}"
            assert req.specifier.contains(entries[name][0], prereleases=True), f"{lock}: {name}=={entries[name][0]} breaks {req}"
    assert "torch" not in dev and "torch" not in runtime
    differ = {n: (v, dev.get(n, (None,))[0]) for n, (v, _) in runtime.items() if dev.get(n, (None,))[0] != v}
    assert not differ, f"runtime.lock and dev.lock pin these differently (or dev lacks them): {differ}"


def test_torch_lock_is_the_constrained_cpu_build():
    pinned = re.search(r"^torch==(\S+)", (CONSTRAINTS / "cpu.txt").read_text(), re.M).group(1)
    (version, hashes), = read_lock("torch-cpu.lock").values()
    assert Version(version).public == pinned and Version(version).local == "cpu", version


def test_this_environment_is_the_dev_lock():
    """What ``./dev install`` made: every locked package at its locked version, and nothing else
    installed but the project itself and torch (a drift here means the install bypassed the lock)."""
    locked = read_lock("dev.lock")
    # the environment's own site-packages only: sys.path can also hold copies vendored inside a
    # package (setuptools appends setuptools/_vendor when it is imported: older packaging, zipp, ...)
    site = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    wrong = {n: (v, installed.get(n)) for n, (v, _) in locked.items() if installed.get(n) != v}
    assert not wrong, f"installed versions differ from dev.lock (locked, installed): {wrong}"
    extra = set(installed) - set(locked) - {"asyncrl", "torch", "pip"}
    assert not extra, f"installed but not locked: {sorted(extra)}"


def test_dev_installs_from_the_locks_with_hashes():
    """The install commands in ``./dev`` (the README's two commands run them): each lock through
    ``install_locked``, whose installs and downloads all check hashes and resolve nothing."""
    text = (REPO / "dev").read_text()
    body = text[text.index("install() {"):text.index("\nlock() {")]
    locked = text[text.index("install_locked() {"):text.index("\ninstall() {")]
    assert 'install_locked "constraints/$extras.lock"' in body
    assert "install_locked constraints/torch-cpu.lock" in body
    assert "--no-deps --no-build-isolation -e ." in body and "pip check" in body
    assert not re.search(r"pip install(?![^\n]*--no-deps)[^\n]*-e", body), "an install that resolves dependencies"
    pip = re.search(r"local pip=\(([^)]*)\)", locked).group(1)
    assert "--require-hashes --no-deps" in pip and locked.count('"${pip[@]}" --no-index --find-links "$WHEELHOUSE" -r "$lock"') == 2
    assert '"${download[@]}" --require-hashes -r "$lock"' in locked and "--no-deps" in locked.split("local download=")[1].split("\n")[0]


def test_a_wheelhouse_file_whose_hash_differs_is_refused(tmp_path):
    """What the wheelhouse relies on: ``--no-index --find-links`` still checks the lock's hash,
    so a file changed in the wheelhouse fails the install instead of running."""
    import hashlib
    import zipfile

    house = tmp_path / "wheels"
    house.mkdir()
    wheel = house / "asyncrl_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("asyncrl_probe.py", "X = 1\n")
        z.writestr("asyncrl_probe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: asyncrl-probe\nVersion: 0.1\n")
        z.writestr("asyncrl_probe-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("asyncrl_probe-0.1.dist-info/RECORD", "")
    lock = tmp_path / "probe.lock"
    lock.write_text(f"asyncrl-probe==0.1 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    argv = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--require-hashes", "--no-deps", "--no-index",
            "--find-links", str(house), "--target", str(tmp_path / "t"), "-r", str(lock)]
    ok = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and (tmp_path / "t" / "asyncrl_probe.py").is_file(), ok.stderr[-2000:]
    with zipfile.ZipFile(wheel, "a") as z:  # the same name, other bytes
        z.writestr("extra.py", "Y = 2\n")
    bad = subprocess.run([*argv[:-4], "--target", str(tmp_path / "t2"), "-r", str(lock)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "t2" / "asyncrl_probe.py").exists()


def test_pip_refuses_a_file_whose_hash_differs(tmp_path):
    """The property the locks rely on, shown on a file of this machine: the torch wheel that
    torch-cpu.lock names installs only with its hash (a changed hash is refused before install)."""
    (version, hashes), = read_lock("torch-cpu.lock").values()
    bad = tmp_path / "bad.lock"
    bad.write_text(f"torch=={version} --hash=sha256:{'0' * 64}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-d", str(tmp_path / "d"),
                           "-r", str(bad)], capture_output=True, text=True, timeout=240, cwd=REPO)
    if "No matching distribution" in proc.stderr or "Could not find a version" in proc.stderr:
        pytest.skip(f"torch=={version} is not on this machine's wheel directory: {proc.stderr[-300:]}")
    assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr, proc.stderr[-2000:]
