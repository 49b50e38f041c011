"""Child side of the python sandbox: set up isolation, then exec the interpreter.

Run by :mod:`tools.sandbox_process` as ``python -I -S _sandbox_launcher.py CONFIG_JSON``
with an empty environment, in a new session, with the run's temporary directory as cwd.
It uses only the standard library and runs *before* any model code, in this order:

1. resource limits (``setrlimit``) except RLIMIT_NPROC, clamped to our hard limits.
2. as root: ``unshare(CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)``:
   private System V IPC and POSIX message queues (a shared-memory segment the program leaves
   dies with the run, never seen by the host or the next run: issue 67 M3) and host name; a network namespace
   whose only interface, ``lo``, is down, a pid namespace (needs CAP_SYS_ADMIN, which default
   Docker does not grant; without it if only that is refused) and a private mount namespace
   in which every world-writable directory (``/tmp``, ``/dev/shm``, ``/var/tmp``, the lock
   directories) is a fresh tmpfs of :data:`PRIVATE_TMPFS_BYTES` (and
   :data:`PRIVATE_TMPFS_INODES` files), gone with the run, each ``hidden`` path (the run
   directory, the data roots) an empty read-only tmpfs, and ``/proc`` is a new procfs
   with ``hidepid=2`` (the run's uid sees its own processes only: no host command lines or
   environments). ``/tmp`` keeps the host's when the interpreter lives under it; the run's
   own directory, when under a fresh tmpfs, is bind-mounted back at its path (the only thing
   of the host's left there). These mounts harden what the namespaces and the per-run uid
   already close: where one is refused (a container's AppArmor profile may refuse a procfs)
   the run goes on, the error reported as ``private_mounts_error``.
3. ``chown`` the cwd to the run's own uid/gid (``uid_base`` + launcher pid; the launcher
   must be root, with CAP_SETUID/SETGID/CHOWN at least), drop supplementary groups,
   ``setresgid``/``setresuid``, check that regaining root fails. Model code never runs as
   the service's uid: without root the launcher refuses.
4. if step 2 did not happen or failed: the same namespaces inside a new user namespace
   (``CLONE_NEWUSER``), as the now unprivileged per-run uid, mapping only that uid onto
   itself. If that fails too, mode ``auto`` accepts a network namespace that has no network
   (only a loopback interface: a container started with ``network_mode: none``, checked in
   ``/proc/net/dev``), reported as ``no_network``; anything else fails closed. There is no
   weaker fallback: an in-interpreter guard does not stop native code (issue 30).
5. RLIMIT_NPROC, now that it is known what the kernel counts (``_process_limit``).
6. ``PR_SET_NO_NEW_PRIVS`` (setuid binaries gain nothing), ``PR_SET_PDEATHSIG``.
7. one report line on stderr (``REPORT_MARKER`` + JSON), then ``execve`` of the
   interpreter on ``main.py`` with an empty environment; with a pid namespace, as pid 2
   under a minimal init (``_run_under_namespace_init``) while we wait to mirror its end.

On any setup failure it writes the report line with ``setup_error`` and exits with
``SETUP_FAILED_EXIT_CODE``; model code never runs with less isolation than reported.
"""

import ctypes
import json
import os
import resource
import signal
import sys

REPORT_MARKER = "\x00asyncrl-sandbox-report "
SETUP_FAILED_EXIT_CODE = 125
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
WORLD_WRITABLE = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock", "/var/lock")
"""Directories any uid may write: each gets a fresh private tmpfs per run (issue 48: /var/tmp
and the lock directories were shared with the host and between runs)."""
PRIVATE_TMPFS_BYTES = 16 * 2**20
PRIVATE_TMPFS_INODES = 1024
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38

def _libc_call(libc, function_name, *args):
    """Call a libc function; None on success, else the OS error text."""
    if getattr(libc, function_name)(*args) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _unshare_network(libc, user_namespace, want_pid_namespace):
    """New network namespace (only a downed ``lo``), IPC and UTS namespaces, and a new pid
    namespace if wanted and allowed.

    Without ``user_namespace`` this needs CAP_SYS_ADMIN (root outside restrictive
    containers). With it, any uid can do it where unprivileged user namespaces are allowed;
    only our own uid/gid are mapped, onto themselves, so the program sees its real ids and
    has no capabilities after exec (its uid is not 0 there).
    Returns (error text or None, whether a pid namespace was created).
    """
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWUSER if user_namespace else CLONE_NEWNS)
    error = "not requested"
    if want_pid_namespace:
        error = _libc_call(libc, "unshare", ctypes.c_int(flags | CLONE_NEWPID))
    with_pid_namespace = error is None
    if error is not None:
        error = _libc_call(libc, "unshare", ctypes.c_int(flags))
    if error is None and user_namespace:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as mapping:
                mapping.write(text)
    return error, with_pid_namespace


def _private_mounts(libc, interpreter, hidden=()):
    """In the new mount namespace (root): nothing propagates back to the host, fresh capped
    tmpfs on every world-writable directory (``WORLD_WRITABLE``), an empty read-only tmpfs over
    each of ``hidden`` (the run directory and data roots: no answer keys, no trajectories), a
    procfs showing only the run's own processes (module docstring). Returns what was mounted;
    raises on any failure."""
    def mount(source, target, fstype, flags, data):
        error = _libc_call(libc, "mount", source, target, fstype, ctypes.c_ulong(flags), data)
        if error is not None:
            raise RuntimeError(f"mount {fstype.decode() if fstype else 'propagation'} on {target.decode()}: {error}")

    mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
    mounted = []
    real = os.path.realpath(interpreter)
    cwd = os.getcwd()
    cwd_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    seen = set()
    try:
        scratch = [(t, f"size={PRIVATE_TMPFS_BYTES},nr_inodes={PRIVATE_TMPFS_INODES},mode=1777", MS_NOSUID | MS_NODEV)
                   for t in WORLD_WRITABLE]
        veiled = [(t, "size=4096,nr_inodes=8,mode=0555", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY) for t in hidden]
        for target, options, flags in scratch + veiled:
            resolved = os.path.realpath(target)
            if resolved in seen or not os.path.isdir(resolved) or resolved == "/":
                continue
            if interpreter.startswith(resolved + "/") or real.startswith(resolved + "/"):
                continue  # the interpreter lives there: keep the host's
            if flags & MS_RDONLY and (cwd + "/").startswith(resolved + "/"):
                continue  # the run's own directory is inside: hiding it would hide the run (work_root elsewhere)
            seen.add(resolved)
            mount(b"tmpfs", resolved.encode(), b"tmpfs", flags, options.encode())
            mounted.append(target)
            if cwd.startswith(resolved + "/"):  # the run's directory lives there: bind it back at its path, alone
                old = os.umask(0o022)  # the path down to it must be traversable by the run's uid, whatever the service's umask
                try:
                    os.makedirs(cwd, mode=0o755, exist_ok=True)
                finally:
                    os.umask(old)
                mount(f"/proc/self/fd/{cwd_fd}".encode(), cwd.encode(), None, MS_BIND, None)
                os.chdir(cwd)
    finally:
        os.close(cwd_fd)
    mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2")
    mounted.append("/proc")
    return mounted


def _apply_rlimits(rlimits):
    applied = {}
    for name, (soft, hard) in rlimits.items():
        kind = getattr(resource, name)
        _, current_hard = resource.getrlimit(kind)
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        resource.setrlimit(kind, (soft, hard))
        applied[name] = [soft, hard]
    return applied


def _process_limit(config, pid_namespace, in_user_namespace):
    """RLIMIT_NPROC for the program, and what the kernel will count against it.

    The kernel counts the tasks of the real uid: with a per-run uid that is this run alone.
    Since Linux 5.14 it counts per (user namespace, uid), and checks the enclosing levels
    against the limit in force when each namespace was made, which is why this limit is
    set only now, after the namespaces: then it is also this run alone. Otherwise the
    service's uid is shared, and the user's current task count is added. The launcher and
    the namespace's init (+2) stay alive, and counted, only with a pid namespace.
    """
    limit = config["max_processes"] + (2 if pid_namespace else 0)
    if config["uid_tasks"] is None:
        return limit, "run"
    if in_user_namespace and tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 14):
        return limit, "run"
    return limit + config["uid_tasks"], "shared-uid"


def _drop_privileges(libc, uid, gid):
    os.chown(".", uid, gid)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise RuntimeError("could regain root after dropping privileges")
    # Changing uid made us non-dumpable, so /proc/self is root's and the user-namespace
    # maps could not be written; exec would make us dumpable again anyway (euid == uid).
    error = _libc_call(libc, "prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)
    if error is not None:
        raise RuntimeError(f"prctl(PR_SET_DUMPABLE) failed: {error}")


def network_interfaces():
    """Names of the network interfaces of this process's network namespace."""
    with open("/proc/net/dev") as table:
        return [line.split(":", 1)[0].strip() for line in table.readlines()[2:] if ":" in line]


def _report(data):
    os.write(2, (REPORT_MARKER + json.dumps(data) + "\n").encode())


def main():
    config = json.loads(sys.argv[1])
    report = {"network": None, "uid": None, "rlimits": None}
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        attempts = {}  # namespace kind -> None (done) or the error
        pid_namespace = False
        report["rlimits"] = _apply_rlimits(config["rlimits"])
        if os.geteuid() == 0:  # must happen before dropping root
            attempts["net"], pid_namespace = _unshare_network(libc, False, config["pid_namespace"])
            if attempts["net"] is None:
                try:
                    report["private_mounts"] = _private_mounts(libc, config["interpreter"], config.get("hidden", ()))
                except (RuntimeError, OSError) as exc:  # hardening on top: the namespaces above still hold
                    report["private_mounts_error"] = str(exc)
        if config["uid_base"] is None or os.geteuid() != 0:
            raise RuntimeError("model code runs only as a per-run uid, which needs the launcher to be root")
        uid = config["uid_base"] + os.getpid()  # unique among live processes
        _drop_privileges(libc, uid, uid)
        report["uid"] = uid
        if attempts.get("net", "not tried") is not None:
            attempts["user+net"], pid_namespace = _unshare_network(
                libc, True, config["pid_namespace"]
            )
        done = [kind for kind, error in attempts.items() if error is None]
        failures = "; ".join(f"{kind}: {error}" for kind, error in attempts.items() if error)
        if done:
            report["network"] = "namespace"
            report["network_namespace"] = done[0]
        elif config["network"] == "auto" and set(network_interfaces()) <= {"lo"}:
            report["network"] = "no_network"  # nothing to reach: this namespace has no interface but loopback
        else:
            raise RuntimeError(f"no network isolation: a network namespace cannot be made here ({failures}) and this "
                               f"process has network interfaces {sorted(set(network_interfaces()) - {'lo'})}")
        report["network_namespace_error"] = failures or None
        report["pid_namespace"] = pid_namespace = pid_namespace and bool(done)
        limit, report["nproc_counts"] = _process_limit(config, pid_namespace, "user+net" in done)
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        report["rlimits"]["RLIMIT_NPROC"] = [limit, limit]
        os.umask(0o077)
        for option, value in ((PR_SET_NO_NEW_PRIVS, 1), (PR_SET_PDEATHSIG, signal.SIGKILL)):
            error = _libc_call(libc, "prctl", option, value, 0, 0, 0)
            if error is not None:
                raise RuntimeError(f"prctl({option}) failed: {error}")
    except Exception as exc:  # report, never run model code half-isolated
        report["setup_error"] = f"{type(exc).__name__}: {exc}"
        _report(report)
        os._exit(SETUP_FAILED_EXIT_CODE)
    interpreter = config["interpreter"]
    argv = [interpreter, "-I", "-S", "-B", "main.py"]
    _report(report)
    if pid_namespace:
        _run_under_namespace_init(libc, interpreter, argv)
    _exec_program(libc, interpreter, argv)


def _exec_program(libc, interpreter, argv):
    _libc_call(libc, "prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # reset by fork
    try:
        os.execve(interpreter, argv, {})
    except OSError as exc:
        _report({"setup_error": f"cannot execute {interpreter}: {exc}"})
        os._exit(SETUP_FAILED_EXIT_CODE)


def _run_under_namespace_init(libc, interpreter, argv):
    """Run the program as pid 2 of the new pid namespace under a minimal init (pid 1).

    When init exits, the kernel kills every process left in the namespace, including
    those that left the process group. The program is not pid 1 itself, because pid 1
    ignores signals it has no handler for (SIGXCPU at the CPU limit, its own kill()).
    init cannot die by a mirrored signal for the same reason, so it passes the program's
    wait status to us through a pipe, and we (outside the namespace) end the same way.
    """
    status_read, status_write = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_read)
        _libc_call(libc, "prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        program = os.fork()
        if program == 0:
            _exec_program(libc, interpreter, argv)
        while True:  # reap orphans too, so that they stop counting against RLIMIT_NPROC
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                break
        os.write(status_write, str(status).encode())
        os._exit(0)
    os.close(status_write)
    _, init_status = os.waitpid(init, 0)
    reported = os.read(status_read, 64)
    _end_like(int(reported) if reported else init_status)


def _end_like(status):
    """Exit with the same code, or die by the same signal, as a wait status says."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            signal.signal(number, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP cannot be changed and need not be
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
