"""Loaded by every Python process the tests start (tests/conftest.py puts this folder on
PYTHONPATH): each name lookup or connection that would leave this machine is appended to
``$SNAKETUNE_NET_LOG`` (and then made as usual). tests/test_offline.py asserts that the
demo pipeline and the tests before it left the log empty: nothing was fetched.

Leaving the machine: a connection to a global (public) address, or a lookup of a name
that is not this machine's or the local test cluster's. Loopback and private addresses
(the rendezvous, gloo, the SLURM daemons) are local.

With ``$SNAKETUNE_CPU_LOG`` set (tests/run.sh sets it), each process also appends, as it
exits, the CPU seconds it used itself (user + system; its children write their own line),
the test that started it (``$SNAKETUNE_TEST``, set by tests/conftest.py for each test) and
its command: tests/durations.py sums them per test file and per kind of process. A process
killed by a signal writes no line. Beside it, in ``$SNAKETUNE_CPU_LOG.modules``, the same
process notes the test and the library modules it loaded (tests/touched.py).
"""

import ipaddress
import os
import socket
import sys

_LOG = os.environ.get("SNAKETUNE_NET_LOG")
_LOCAL_NAMES = {"", "localhost", "tupi1", "tupi2", socket.gethostname()}


def _append(path: str, line: str) -> None:
    """One line appended in one write (processes running at once share the file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _record(what: str) -> None:
    _append(_LOG, f"{os.getpid()} {what} ({' '.join(sys.argv[:3])[:200]})\n")


def _outside_address(host) -> bool:
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_global
    except ValueError:
        return False


def _outside_name(host) -> bool:
    if host is None:
        return False
    name = host.decode() if isinstance(host, bytes) else str(host)
    try:
        ipaddress.ip_address(name.split("%")[0])
        return _outside_address(name)
    except ValueError:
        return name.lower() not in _LOCAL_NAMES


if _LOG:
    # which processes ran under the watch (the test checks the demo's stages did)
    # (and a prefix for compiled files, which makes a process compile every module it
    # imports from source: tests/test_offline.py checks that no process of the demo had one)
    _prefix = f" pycache_prefix={sys.pycache_prefix}" if sys.pycache_prefix else ""
    _append(_LOG + ".seen", f"{os.getpid()} {' '.join(sys.argv[:2])[:200]}{_prefix}\n")
    _getaddrinfo = socket.getaddrinfo
    _connect = socket.socket.connect
    _connect_ex = socket.socket.connect_ex

    def getaddrinfo(host, port, *args, **kwargs):
        if _outside_name(host):
            _record(f"lookup {host}:{port}")
        return _getaddrinfo(host, port, *args, **kwargs)

    def connect(self, address):
        if isinstance(address, tuple) and _outside_address(address[0]):
            _record(f"connect {address[0]}:{address[1]}")
        return _connect(self, address)

    def connect_ex(self, address):
        if isinstance(address, tuple) and _outside_address(address[0]):
            _record(f"connect {address[0]}:{address[1]}")
        return _connect_ex(self, address)

    socket.getaddrinfo = getaddrinfo
    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex


_CPU_LOG = os.environ.get("SNAKETUNE_CPU_LOG")
counted_per_test = False  # pytest's own process: tests/conftest.py writes a line per test


def cpu_seconds() -> float:
    """This process's own CPU seconds so far (user + system)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def cpu_line(seconds: float, test: str, command: str) -> None:
    if _CPU_LOG:
        _append(_CPU_LOG, f"{os.getpid()}\t{seconds:.2f}\t{test}\t"
                          f"{command.replace(chr(9), ' ')[:300]}\n")  # fmt: skip


def loaded_modules() -> str:
    """The library modules this process has loaded, and the workflow script it runs (a
    scripts/*.py or bench/*.py entry): what tests/touched.py maps a test to."""
    names = sorted(m for m in sys.modules if m == "snaketune" or m.startswith("snaketune."))
    entry = sys.argv[0] if sys.argv else ""
    parent = os.path.basename(os.path.dirname(entry))
    if entry.endswith(".py") and parent in ("scripts", "bench"):
        names.append(f"{parent}/{os.path.basename(entry)}")
    return ",".join(names)


if _CPU_LOG:
    import atexit

    def _at_exit() -> None:
        test = os.environ.get("SNAKETUNE_TEST", "")
        if not counted_per_test:
            cpu_line(cpu_seconds(), test, " ".join(sys.argv[:3]))
            modules = loaded_modules()
            if modules:
                command = " ".join(sys.argv[:2]).replace("\t", " ")[:200]
                _append(_CPU_LOG + ".modules", f"{test}\t{command}\t{modules}\n")

    atexit.register(_at_exit)
