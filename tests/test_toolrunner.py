"""A user's tools run in a child process of the rank (snaketune.tools.toolrunner): a tool
that raises, one that hangs past its limit, one that prints and returns megabytes and one
that kills its process each come back as text the model is told, counted, and the next call
goes on; the functions the trainer is handed describe the tools as the user wrote them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

TOOLS = '''
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"no {x}")


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def chatty(n: int) -> str:
    """Prints and returns a lot.

    Args:
        n: How many characters.
    """
    print("y" * n)
    return "x" * n


def die(code: int) -> str:
    """Ends its process.

    Args:
        code: The exit code.
    """
    os._exit(code)
'''


@pytest.fixture
def runner(tmp_path, monkeypatch):
    from snaketune.tools.toolrunner import ToolRunner

    (tmp_path / "my_tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)  # user keys are found from the working directory
    keys = [f"my_tools.py:{n}" for n in ("add", "boom", "hang", "chatty", "die")]
    made = ToolRunner(keys, timeout_s=1.5, max_chars=1000)
    yield made
    made.close()


def test_each_kind_of_failing_tool_is_told_to_the_model_counted_and_survived(runner):
    from snaketune.tools.toolrunner import ToolFailed

    assert runner.call("add", {"a": 12, "b": 30}) == "42"
    first = runner._process.pid
    with pytest.raises(ToolFailed, match="ValueError: no 7"):
        runner.call("boom", {"x": 7})
    began = time.monotonic()
    with pytest.raises(ToolFailed, match="did not finish within 1.5 s"):
        runner.call("hang", {"seconds": 30})
    assert time.monotonic() - began < 10
    out = runner.call("chatty", {"n": 5_000_000})
    assert len(out) == 1000 and out == "x" * 1000  # its result first, cut; the prints dropped
    with pytest.raises(ToolFailed, match="process ended without a result"):
        runner.call("die", {"code": 3})
    assert runner.call("add", {"a": 1, "b": 2}) == "3"  # a new process after each death
    assert runner._process.pid != first
    c = runner.counts
    assert (c.calls, c.errors, c.timeouts, c.died, c.cut) == (6, 1, 1, 1, 1)


# the tools above behind a heavy import on a loaded node
SLOW_IMPORT = "import time\n\ntime.sleep(2.5)\n" + TOOLS


def test_a_call_s_time_limit_counts_from_a_loaded_tool_process(tmp_path, monkeypatch):
    """The tool process's start (a spawned interpreter importing the user's tools: here
    2.5 s, past the 1.5 s a call may take) is not the call's: the first call and the first
    after a hang are answered, where both were ended as hung before; a tools file that
    cannot load is told as a process that did not start, counted as died."""
    from snaketune.tools.toolrunner import ToolFailed, ToolRunner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text(SLOW_IMPORT)
    runner = ToolRunner(["slow.py:add", "slow.py:hang"], timeout_s=1.5, max_chars=100)
    try:
        assert runner.call("add", {"a": 1, "b": 2}) == "3"
        with pytest.raises(ToolFailed, match="did not finish within 1.5 s"):
            runner.call("hang", {"seconds": 30})
        assert runner.call("add", {"a": 2, "b": 2}) == "4"  # a new process, its start not timed
        assert (runner.counts.calls, runner.counts.timeouts) == (3, 1)
    finally:
        runner.close()
    # a start past its limit (here 1 s) is a process that did not start
    monkeypatch.setattr("snaketune.tools.toolrunner.STARTUP_S", 1.0)
    late = ToolRunner(["slow.py:add"], timeout_s=30, max_chars=100)
    try:
        with pytest.raises(ToolFailed, match="add's process did not start: .* over 1 s"):
            late.call("add", {"a": 1, "b": 2})
        assert (late.counts.died, late._process) == (1, None)
    finally:
        late.close()
    (tmp_path / "broken.py").write_text("raise ImportError('no such thing')\n")
    broken = ToolRunner(["broken.py:add"], timeout_s=1.5, max_chars=100)
    try:
        with pytest.raises(ToolFailed, match="add's process did not start"):
            broken.call("add", {"a": 1, "b": 2})
        assert (broken.counts.calls, broken.counts.died, broken._process) == (1, 1, None)
    finally:
        broken.close()


def test_the_hung_tools_process_is_gone_and_close_leaves_no_process(runner):
    import psutil

    from snaketune.tools.toolrunner import ToolFailed

    runner.call("add", {"a": 1, "b": 1})
    # a daemon: a rank's exit does not wait for it (a rank that exits without close: the
    # test below, in a process of its own)
    assert runner._process.daemon
    hung = runner._process.pid
    with pytest.raises(ToolFailed):
        runner.call("hang", {"seconds": 30})
    assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
    runner.call("add", {"a": 1, "b": 1})
    alive = runner._process.pid
    runner.close()
    assert not psutil.pid_exists(alive) or psutil.Process(alive).status() == psutil.STATUS_ZOMBIE


def test_the_functions_describe_the_tools_as_the_user_wrote_them(runner):
    """transformers' schema of each function the trainer gets is the user's function's
    (TRL shows the model the tools from it), and calling it runs the tool in the child."""
    from transformers.utils import get_json_schema

    from snaketune.evaluation.rewards import _load

    functions = runner.functions()
    assert [f.__name__ for f in functions] == ["add", "boom", "hang", "chatty", "die"]
    for f in functions:
        assert get_json_schema(f) == get_json_schema(_load(f"my_tools.py:{f.__name__}"))
    assert functions[0](a=2, b=3) == "5" and runner.counts.calls == 1


SHOP = '''
import time


class Shop:
    """One rollout's basket."""

    def __init__(self):
        self.basket = []

    def reset(self, **kwargs):
        self.basket = []
        return f" (customer {kwargs['customer']})"

    def buy(self, item: str) -> str:
        """Put an item in the basket.

        Args:
            item: What to buy.
        """
        self.basket.append(item)
        return ", ".join(self.basket)

    def stall(self) -> str:
        """Never answers."""
        time.sleep(600)
        return "late"

    def get_reward(self) -> float:
        return float(len(self.basket))
'''


def test_an_environment_s_instances_keep_their_own_state_in_the_tool_process(tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """Each instance of the class TRL's environment_factory is given is a slot of the tool
    process's: its state its own, its methods described as the user wrote them, reset's and
    get_reward's values as they are; a call past the limit is told and counted, the slot's
    state lost with the process is told, and reset starts it again."""
    import inspect

    from transformers.utils import get_json_schema

    from snaketune.evaluation.rewards import _load
    from snaketune.tools.toolrunner import ToolFailed, ToolRunner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "shop.py").write_text(SHOP)
    runner = ToolRunner([], timeout_s=1.5, max_chars=100, environment="shop.py:Shop")
    try:
        cls = runner.environment_class()
        one, two = cls(), runner.environment_class()()  # one class: two slots
        user = _load("shop.py:Shop")()
        assert get_json_schema(one.buy) == get_json_schema(user.buy)
        assert [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if n[0] != "_"] == [
            "buy", "get_reward", "reset", "stall"]  # fmt: skip
        assert (
            one.reset(customer="ann", prompt=[{"role": "user", "content": "hi"}])
            == " (customer ann)"
        )
        assert two.reset(customer="bo") == " (customer bo)"
        assert one.buy(item="tea") == "tea" and one.buy("milk") == "tea, milk"
        assert two.buy(item="jam") == "jam"
        assert one.get_reward() == 2.0 and two.get_reward() == 1.0
        with pytest.raises(ToolFailed, match="did not finish within 1.5 s"):
            two.stall()
        with pytest.raises(ToolFailed, match="state was lost with its process"):
            one.buy(item="tea")
        assert one.get_reward() is None  # no reward for a rollout whose state is gone
        one.reset(customer="ann")
        assert one.buy(item="bread") == "bread"
        assert runner.counts.timeouts == 1 and runner.counts.errors == 1
    finally:
        runner.close()


COUNTER = '''
class Counter:
    """Counts its resets (a state reset does not clear)."""

    def __init__(self):
        self.resets = 0

    def reset(self, **kwargs):
        self.resets += 1
        return f"{self.resets}"

    def bump(self) -> str:
        """Adds one (a method whose name sorts before get_reward)."""
        self.resets += 1
        return f"{self.resets}"

    def tally(self, by: int) -> str:
        """Adds to the count.

        Args:
            by: How much.
        """
        self.resets += by
        return f"{self.resets}"

    def get_reward(self) -> float:
        return self.resets / 2
'''

LOOP_TOOLS = """
def add(a: int, b: int) -> int:
    return a + b


def same(text: str) -> str:
    return text


def shout(text: str) -> str:
    print("said", text)
    return text.upper()


def boom(x: int) -> int:
    raise ValueError(f"no {x}")
"""


def test_the_tool_process_loop_answers_each_call_and_each_edge_here(tmp_path, monkeypatch):
    """The tool process's side (``_serve``, ``_dispatch``: the tests above run it in a
    spawned process, out of a mutant's reach) run here in a thread on a pipe: a value as
    JSON and a text as it is; a failure as its type and message; what a tool prints after
    its result (within ``max_chars``); a text of exactly ``max_chars`` whole and uncut, one more cut and said so;
    an environment's slots (reset makes one once, a second reset keeps its state, a slot
    not made has no reward and its tool calls are told the state is lost); reset's and
    get_reward's values as JSON; the streams put back after a failure; None or the
    rank's end ends the loop."""
    import json
    import multiprocessing
    import sys
    import threading

    from snaketune.tools.toolrunner import _serve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(LOOP_TOOLS)
    (tmp_path / "c.py").write_text(COUNTER)
    keys = [f"t.py:{n}" for n in ("add", "same", "shout", "boom")]

    def serve(environment=None):
        parent, child = multiprocessing.Pipe()

        def loop_of():  # what the loop raises is kept: the rank's end is a plain return
            try:
                _serve(child, keys, 20, environment)
            except BaseException as exc:
                raised.append(exc)

        loop = threading.Thread(target=loop_of, daemon=True)
        loop.start()
        assert parent.poll(10) and parent.recv() == "ready"  # its tools loaded, before a call

        def ask(name, kwargs):
            parent.send((name, kwargs))
            assert parent.poll(10), name
            return parent.recv()

        return parent, loop, ask

    raised = []
    streams = (sys.stdout, sys.stderr)
    parent, loop, ask = serve("c.py:Counter")
    assert ask("add", {"a": 2, "b": 3}) == ("ok", "5", False)
    assert ask("same", {"text": "hi"}) == ("ok", "hi", False)  # a text is not quoted
    assert ask("same", {"text": ""}) == ("ok", "", False)
    assert ask("boom", {"x": 7}) == ("error", "ValueError: no 7", False)
    assert (sys.stdout, sys.stderr) == streams
    assert ask("shout", {"text": "a"}) == ("ok", "A\n[printed] said a\n", False)
    assert ask("same", {"text": "x" * 20}) == ("ok", "x" * 20, False)
    assert ask("same", {"text": "x" * 21}) == ("ok", "x" * 20, True)
    assert ask("shout", {"text": "b" * 5}) == ("ok", "BBBBB\n[printed] said", True)
    assert ask((1, "get_reward"), {}) == ("ok", "null", False)  # no slot 1 yet
    # its call told the state is lost (cut to 20 here; whole above)
    assert ask((1, "tally"), {"by": 1}) == ("error", "RuntimeError: the en", True)
    assert ask((1, "bump"), {}) == ("error", "RuntimeError: the en", True)
    assert ask((0, "reset"), {"prompt": "p"}) == ("ok", '"1"', False)  # its value: JSON
    assert ask((0, "reset"), {}) == ("ok", '"2"', False)  # the same instance
    assert ask((0, "tally"), {"by": 3}) == ("ok", "5", False)  # a tool's text as it is
    assert ask((0, "get_reward"), {}) == ("ok", json.dumps(2.5), False)
    assert ask((2, "reset"), {}) == ("ok", '"1"', False)  # another slot: its own instance
    assert ask("boom", {"x": 0}) == ("error", "ValueError: no 0", False)
    assert (sys.stdout, sys.stderr) == streams
    parent.send(None)
    loop.join(10)
    assert not loop.is_alive()
    parent, loop, ask = serve()  # no environment
    assert ask("add", {"a": 0, "b": 0}) == ("ok", "0", False)
    parent.close()  # the rank is gone
    loop.join(10)
    assert not loop.is_alive() and raised == []


def test_close_lets_the_tool_process_end_itself(tmp_path, monkeypatch):
    """``close`` asks the tool process to end (what it holds flushed, its exit handlers
    run) before it is killed: a killed one writes nothing more."""
    from snaketune.tools.toolrunner import ToolRunner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(LOOP_TOOLS + "\nimport atexit\n\natexit.register("
                                   "lambda: open('ended.txt', 'w').write('bye'))\n")  # fmt: skip
    runner = ToolRunner(["t.py:add"], timeout_s=30, max_chars=100)
    assert runner.call("add", {"a": 1, "b": 2}) == "3"
    runner.close()
    assert (tmp_path / "ended.txt").read_text() == "bye"
    assert runner._process is None


def test_a_rank_that_ends_without_closing_its_runner_exits(tmp_path):
    """A rank that dies or returns without ``close`` (an exception past the trainer) must
    not wait at its exit for its tool process, which waits for the next call."""
    (tmp_path / "t.py").write_text(LOOP_TOOLS)
    script = (
        "from snaketune.tools.toolrunner import ToolRunner\n"
        "runner = ToolRunner(['t.py:add'], timeout_s=30, max_chars=100)\n"
        "assert runner.call('add', {'a': 1, 'b': 2}) == '3'\n"
    )
    # (a wait at exit would be for ever: the timeout ends it, and the test fails)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_killed_rank_s_hung_tool_process_ends(tmp_path):
    """A rank SIGKILLed (the OOM killer, a node's scancel) while its tool hangs: the tool
    process finds its rank gone and ends, not left running for ever on the node."""
    import os
    import signal

    (tmp_path / "my_tools.py").write_text(TOOLS)
    script = (
        "import threading, time\n"
        "from snaketune.tools.toolrunner import ToolRunner\n"
        "runner = ToolRunner(['my_tools.py:hang'], timeout_s=3600, max_chars=100)\n"
        "threading.Thread(target=runner.call, args=('hang', {'seconds': 3600})).start()\n"
        "while runner._process is None or runner._conn is None:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(0.5)\n"
        "print(runner._process.pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    tool = int(rank.stdout.readline())
    assert Path(f"/proc/{tool}/cmdline").read_text()  # the tool process runs, hung in its call
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()

    def ended() -> bool:
        try:
            return Path(f"/proc/{tool}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 20
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not ended()
    if alive:
        os.kill(tool, signal.SIGKILL)
    assert not alive, "the hung tool's process outlived its killed rank"


def test_a_tool_process_ends_itself_when_its_rank_is_gone(monkeypatch):
    """The watch ends the process (``os._exit``) once its parent is another process, and
    keeps waiting while it is the same."""
    import threading

    from snaketune.tools import toolrunner

    # this thread's calls only: an earlier test's tool loop run in this process leaves its
    # own watch thread, which sees the patched parent change too
    me = threading.current_thread()
    ended, parents = [], iter([7, 7, 1])
    real = toolrunner.os.getppid()

    def mine() -> bool:
        return threading.current_thread() is me

    monkeypatch.setattr(toolrunner.os, "getppid", lambda: next(parents) if mine() else real)
    monkeypatch.setattr(toolrunner.os, "_exit", lambda code: mine() and ended.append(code))
    monkeypatch.setattr(toolrunner, "PARENT_POLL_S", 0.0)
    toolrunner._watch_parent(7)
    assert ended == [1]
