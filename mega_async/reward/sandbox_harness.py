"""The code reward's two processes inside the sandbox: `python -I -c <this file> worker|judge FD FD [FD]`.

worker: runs the solution and answers the judge's requests (call this, read that attribute, ...) with plain
values (None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset) or a handle. It
never sees the tests and holds no channel out of the sandbox.
judge: runs the item's tests with the solution's names bound to proxies (never a builtin's or a dunder's
name; modules are the judge's own imports). Every value a test compares was decoded from the worker's reply
into a fresh plain object in the judge, so no object of the solution's answers `==`, `bool()` or `repr()`
there; a handle compares by identity and refuses `bool()`. The worker's replies are data only. The judge
reports `{"passed": p, "done": i}` after each test on the one descriptor the worker does not hold.
Standard library only; the launcher (sandbox.py) passes this file's text, so nothing else is imported.
"""
import builtins
import json
import os
import select
import struct
import sys
import time

MAX_MESSAGE = 32 << 20  # bytes of one request or reply (a test may pass a list of a million ints)
MAX_ITEMS = 100_000  # elements `list(handle)` may take from an iterator of the solution's
_HEADER = struct.Struct(">I")


class Gone(BaseException):
    """The worker died, broke the protocol or missed the deadline (BaseException: a test cannot catch it)."""


def send(fd: int, obj) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes is over {MAX_MESSAGE}")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def recv(fd: int, deadline: float):
    """One message, or Gone when the peer closed, sent garbage or `deadline` (monotonic) passed."""
    def read(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Gone("no reply before the deadline")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise Gone("the solution's process exited")
            buf += chunk
        return bytes(buf)
    size = _HEADER.unpack(read(_HEADER.size))[0]
    if size > MAX_MESSAGE:
        raise Gone(f"reply of {size} bytes is over {MAX_MESSAGE}")
    try:
        return json.loads(read(size))
    except (ValueError, RecursionError) as e:
        raise Gone(f"unreadable reply ({type(e).__name__})") from None


# --- the wire form of values: JSON, with tags for what JSON lacks ----------------------------------------
# null/true/false/str/float and ints below 2**53 as themselves, [..] a list, {"i": hex} a larger int,
# {"t": [..]} tuple, {"s": [..]} set, {"f": [..]} frozenset, {"d": [[k, v], ..]} dict, {"b": hex} bytes,
# {"c": [re, im]} complex, {"r": id, "n": type name} an object that stays in the worker, {"m": name} a module.

def encode(x, handle, depth: int = 0):
    """`x` in wire form; `handle(obj)` gives the tag of anything that is not a plain value."""
    if depth > 100:
        raise ValueError("nested more than 100 levels")
    t, d = type(x), depth + 1
    if x is None or t is bool or t is str or t is float:
        return x
    if t is int:
        return x if -(1 << 53) < x < (1 << 53) else {"i": hex(x)}
    if t is list:
        return [encode(v, handle, d) for v in x]
    if t is tuple:
        return {"t": [encode(v, handle, d) for v in x]}
    if t is dict:
        return {"d": [[encode(k, handle, d), encode(v, handle, d)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [encode(v, handle, d) for v in x]}
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    return handle(x)


def decode(w, remote):
    """A fresh plain value from wire form (`remote(tag)` builds what stands for an object of the worker's)."""
    if w is None or type(w) in (bool, str, float, int):
        return w
    if type(w) is list:
        return [decode(v, remote) for v in w]
    if type(w) is not dict or len(w) != 1 and "r" not in w:
        raise ValueError("not a wire value")
    if "i" in w:
        return int(w["i"], 16)
    if "t" in w:
        return tuple(decode(v, remote) for v in w["t"])
    if "s" in w:
        return {decode(v, remote) for v in w["s"]}
    if "f" in w:
        return frozenset(decode(v, remote) for v in w["f"])
    if "d" in w:
        return {decode(k, remote): decode(v, remote) for k, v in w["d"]}
    if "b" in w:
        return bytes.fromhex(w["b"])
    if "c" in w:
        return complex(float(w["c"][0]), float(w["c"][1]))
    return remote(w)


# --- worker ------------------------------------------------------------------------------------------------

def _plain(x):
    """What an honest value means as a plain one: subclasses as their base type, numpy scalars and arrays."""
    for base in (bool, int, float, complex, str, bytes, tuple, list, dict, frozenset, set):
        if isinstance(x, base):
            return base(x) if base is not dict else dict(x.items())
    if isinstance(x, bytearray):
        return bytes(x)
    if type(x).__module__ == "numpy" and hasattr(x, "tolist"):
        return x.tolist()  # numpy scalars and arrays
    raise TypeError


def worker(requests: int, replies: int) -> None:
    code = sys.stdin.buffer.read().decode()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    objects: dict[int, object] = {}

    def ref(x):
        objects[id(x)] = x
        return {"r": id(x), "n": type(x).__name__}

    def handle(x):
        if type(x).__name__ == "module":
            return {"m": x.__name__}
        try:
            return encode(_plain(x), handle)
        except TypeError:
            return ref(x)

    def export(x):  # a large plain global stays in the worker (tests index it remotely)
        w = encode(x, handle)
        return w if len(json.dumps(w)) <= 1 << 16 else ref(x)

    def value(w):
        return decode(w, lambda tag: objects[tag["r"]])

    def reply(fn):
        try:
            out = {"v": encode(fn(), handle)}
        except BaseException as e:  # noqa: BLE001 - the solution's exception goes to the test as its builtin type
            base = next(c for c in type(e).__mro__ if c.__module__ == "builtins")
            out = {"e": base.__name__, "m": str(e)[:500]}
        try:
            send(replies, out)
        except (ValueError, RecursionError, TypeError) as e:
            send(replies, {"e": "ValueError", "m": f"the solution's value cannot be sent: {e}"})

    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
        names = {k: v for k, v in ns.items() if not k.startswith("__")}
        send(replies, {"names": {k: export(v) for k, v in names.items()}})
    except BaseException as e:  # noqa: BLE001 - a solution that does not run passes no test
        send(replies, {"error": f"{type(e).__name__}: {str(e)[:300]}"})
        return
    ops = {
        "call": lambda o, q: o(*value(q["a"]), **value(q["k"])),
        "getattr": lambda o, q: getattr(o, q["name"]),
        "getitem": lambda o, q: o[value(q["key"])],
        "len": lambda o, q: len(o),
        "contains": lambda o, q: value(q["x"]) in o,
        "list": lambda o, q: [v for _, v in zip(range(MAX_ITEMS + 1), o)],
        "str": lambda o, q: str(o),
    }
    while True:
        try:
            q = recv(requests, time.monotonic() + 3600)
        except Gone:
            return
        reply(lambda: ops[q["op"]](objects[q["r"]], q))


# --- judge -------------------------------------------------------------------------------------------------

class Judge:
    def __init__(self, requests: int, replies: int, deadline: float):
        self.requests, self.replies, self.deadline, self.gone = requests, replies, deadline, None

    def ask(self, op: str, ref: int, **fields):
        if self.gone is not None:
            raise Gone(self.gone)
        try:
            send(self.requests, {"op": op, "r": ref, **fields})
            out = recv(self.replies, self.deadline)
        except (BrokenPipeError, Gone) as e:
            self.gone = str(e) or type(e).__name__
            raise Gone(self.gone) from None
        if type(out) is dict and "v" in out:
            return self.value(out["v"])
        name = out.get("e") if type(out) is dict else None
        cls = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        try:
            exc = cls(str(out.get("m", "")))
        except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError takes five arguments
            exc = RuntimeError(str(out.get("m", "")))
        raise exc

    def value(self, w):
        return decode(w, lambda tag: Remote(self, int(tag["r"]), str(tag.get("n", "object"))))

    def wire(self, x):
        def handle(obj):
            if type(obj) is Remote:
                return {"r": obj._ref}
            if isinstance(obj, (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)):
                return encode(_plain(obj), handle)
            raise TypeError(f"a test can pass only plain values to the solution, not {type(obj).__name__}")
        return encode(x, handle)

    def bind(self, names: dict) -> dict:
        """The test namespace: the solution's names, except dunders and builtins (a test's `abs`, `len` or
        `__builtins__` are never the solution's); a module is imported here by its name, so `math.isclose`
        or `np.allclose` is the real one (only the installation's modules: the judge's path has no scratch)."""
        import importlib
        ns = {"__name__": "__main__", "__builtins__": builtins}
        for name, w in names.items():
            if type(name) is not str or not name.isidentifier() or name.startswith("__") or hasattr(builtins, name):
                continue
            if type(w) is dict and set(w) == {"m"}:
                mod = w["m"]
                if type(mod) is str and all(part.isidentifier() for part in mod.split(".")):
                    try:
                        ns[name] = importlib.import_module(mod)
                    except BaseException:  # noqa: BLE001 - a module that does not import here stays unbound
                        pass
                continue
            ns[name] = self.value(w)
        return ns

    def run(self, tests: list, report, debug: bool = False) -> None:
        passed = 0
        report(passed, 0)
        try:
            first = recv(self.replies, self.deadline)
        except Gone:
            return
        names = first.get("names") if type(first) is dict else None
        if type(names) is not dict:
            return  # the solution did not run: no test passes
        try:
            ns = self.bind(names)
        except Exception:  # noqa: BLE001 - a malformed export list passes no test
            return
        for i, test in enumerate(tests):
            try:
                exec(compile(test, f"test_{i}", "exec"), ns)
                ok = self.gone is None
            except BaseException:  # noqa: BLE001 - a failing or raising test does not pass
                ok = False
                if debug:  # the launcher's stderr: which test failed and why
                    import traceback
                    traceback.print_exc()
            passed += ok
            report(passed, i + 1)
            if self.gone is not None:
                return


class Remote:
    """An object that stays in the worker: calls, attributes, items, `len`, `in`, `str` and iteration are
    asked of the worker and answered with plain values; equality is identity and truth is refused."""
    __slots__ = ("_judge", "_ref", "_type")

    def __init__(self, judge: Judge, ref: int, type_name: str):
        self._judge, self._ref, self._type = judge, ref, type_name

    def __call__(self, *args, **kwargs):
        return self._judge.ask("call", self._ref, a=self._judge.wire(list(args)), k=self._judge.wire(kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # protocols (__array_interface__, ...) stay local
            raise AttributeError(name)
        return self._judge.ask("getattr", self._ref, name=name)

    def __getitem__(self, key):
        return self._judge.ask("getitem", self._ref, key=self._judge.wire(key))

    def __len__(self) -> int:
        return self._judge.ask("len", self._ref)

    def __contains__(self, x) -> bool:
        return self._judge.ask("contains", self._ref, x=self._judge.wire(x)) is True

    def __iter__(self):
        items = self._judge.ask("list", self._ref)
        if type(items) is not list or len(items) > MAX_ITEMS:
            raise ValueError(f"the solution's iterator gave more than {MAX_ITEMS} items")
        return iter(items)

    def __str__(self) -> str:
        return self._judge.ask("str", self._ref)  # str() insists on a str: a plain one, made by the worker

    def __bool__(self) -> bool:
        raise TypeError(f"the solution returned a {self._type}, not a plain value (bool, int, str, list, ...)")

    def __repr__(self) -> str:
        return f"<the solution's {self._type}>"


def judge(verdict: int, requests: int, replies: int) -> None:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the worker cannot open /proc/<judge>/fd or mem
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)

    def report(passed: int, done: int) -> None:
        os.write(verdict, (json.dumps({"passed": passed, "done": done}) + "\n").encode())

    deadline = time.monotonic() + float(job["timeout"])
    Judge(requests, replies, deadline).run(list(job["tests"]), report, bool(job.get("debug")))


if __name__ == "__main__":
    sys.set_int_max_str_digits(100_000)
    role, fds = sys.argv[1], [int(a) for a in sys.argv[2:]]
    (worker if role == "worker" else judge)(*fds)
