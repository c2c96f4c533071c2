"""Simulated hosts for multi-host tests: one network namespace per "host", all joined to a
bridge in a dedicated "switch" namespace, so nothing in the root namespace changes.

    switch namespace <prefix>-sw:  br0 <- port0, port1, ... (no addresses)
    host namespace <prefix>-h<i>:  lo (up), pcnet<i> = 198.18.0.<i+1>/24, the peer of port<i>

Each host namespace has exactly one interface besides lo, so pycomm's TCP transport
selects it with or without PYCOMM_SOCKET_IFNAME. Optionally every host's link is shaped
with `tc qdisc ... tbf` on the host side of its veth, i.e. the host's egress: with two
hosts that limits both directions of the one link between them.

Names carry the creating process's pid and start time (<prefix> = pcnet-<pid>-<start>-<n>),
so concurrent runs never clash, and namespaces left by a process that is gone (killed
test runs) are recognised exactly and swept by the next run. Teardown kills every
process still inside the namespaces (only descendants of this run can be there), then
deletes them, which deletes their veths and the bridge; it runs on every exit path of the
context manager and never raises.

Root only: `available()` says whether this machine can do it, and why not.

Also here, for tests and benchmarks alike: `torchrun_commands()` (one multi-node torchrun
per host, c10d rendezvous on host 0) and `run_jobs()` (runs them under one deadline and
always stops everything it started).
"""

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

NAME_PREFIX = "pcnet"
SUBNET = "198.18.0"          # from 198.18.0.0/15 (RFC 2544 benchmarking range)
PREFIX_LEN = 24
BRIDGE = "br0"
# Seconds any single `ip`/`tc` command may take.
_CMD_TIMEOUT_S = 20
_NAME_RE = re.compile(r"^%s-(\d+)-(\d+)-\d+-(?:sw|h\d+|probe)$" % NAME_PREFIX)
_seq = itertools.count()
_availability = None


def _tool(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")


IP = _tool("ip")
TC = _tool("tc")


def _run(argv, check=True):
    """Runs a command; raises RuntimeError with its output when check and it fails."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=_CMD_TIMEOUT_S, text=True)
    except subprocess.TimeoutExpired:
        if check:
            raise RuntimeError("%s: timed out after %d s" % (" ".join(argv), _CMD_TIMEOUT_S))
        return None
    if check and p.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(argv), p.returncode, p.stdout.strip()))
    return p


def _start_ticks(pid):
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), or
    None when it does not exist. With the pid it identifies a process across pid reuse."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after it don't.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def _new_prefix():
    pid = os.getpid()
    return "%s-%d-%d-%d" % (NAME_PREFIX, pid, _start_ticks(pid) or 0, next(_seq))


def _list_namespaces():
    p = _run([IP, "netns", "list"], check=False)
    if p is None or p.returncode != 0:
        return []
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _kill_inside(ns):
    """SIGKILLs every process inside namespace `ns` (by pid, as `ip netns pids` lists them)
    and waits briefly for them to be gone. Those are processes this run started there."""
    for _ in range(50):
        p = _run([IP, "netns", "pids", ns], check=False)
        pids = [int(x) for x in p.stdout.split() if x.isdigit()] if p and p.returncode == 0 else []
        pids = [x for x in pids if x != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)


def _delete_namespace(ns):
    _kill_inside(ns)
    _run([IP, "netns", "delete", ns], check=False)


def sweep_stale():
    """Deletes namespaces of this helper whose creating process is gone. Returns their names."""
    swept = []
    for ns in _list_namespaces():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        pid, ticks = int(m.group(1)), int(m.group(2))
        if _start_ticks(pid) == ticks:
            continue  # its creator still runs: not ours to touch
        _delete_namespace(ns)
        swept.append(ns)
    return swept


def available():
    """(True, "") when namespaces, veth pairs, a bridge and a tbf qdisc can be created here,
    else (False, reason). Probes once per process by doing it; leaves nothing behind."""
    global _availability
    if _availability is not None:
        return _availability
    if os.geteuid() != 0:
        _availability = (False, "network namespaces need root (euid %d)" % os.geteuid())
        return _availability
    if not IP:
        _availability = (False, "iproute2 'ip' not found")
        return _availability
    if not TC:
        _availability = (False, "iproute2 'tc' not found")
        return _availability
    probe = _new_prefix() + "-probe"
    try:
        _run([IP, "netns", "add", probe])
        _run([IP, "-n", probe, "link", "add", BRIDGE, "type", "bridge"])
        _run([IP, "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        _run([IP, "-n", probe, "link", "set", "pb", "master", BRIDGE])
        _run([IP, "netns", "exec", probe, TC, "qdisc", "add", "dev", "pa", "root", "tbf",
              "rate", "1gbit", "burst", "256kb", "latency", "50ms"])
        _availability = (True, "")
    except (RuntimeError, OSError) as e:
        _availability = (False, "cannot build network namespaces here: %s" % e)
    finally:
        _delete_namespace(probe)
    return _availability


def _burst_bytes(rate):
    """tbf bucket for `rate` (tc syntax, e.g. "1gbit", "200mbit"): 2 ms worth, at least
    64 KiB, so that one TSO segment always fits (tbf segments larger GSO packets anyway)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError("rate %r: expected a number with kbit, mbit, gbit, bit (or bps)" % rate)
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    bytes_per_s = value / 8 if m.group(3) == "bit" else value
    return max(64 * 1024, int(bytes_per_s * 0.002))


class Host:
    """One simulated host: its namespace, interface and address."""

    def __init__(self, index, netns, ifname, addr):
        self.index = index
        self.netns = netns
        self.ifname = ifname
        self.addr = addr

    def command(self, argv):
        """`argv` run inside this host's namespace."""
        return [IP, "netns", "exec", self.netns] + list(argv)

    def __repr__(self):
        return "Host(%d, %s, %s=%s)" % (self.index, self.netns, self.ifname, self.addr)


class Hosts:
    """Context manager building `n` hosts on one switch; `rate` (tc syntax, e.g. "1gbit")
    shapes each host's egress with tbf. `.hosts[i]` is host i, at 198.18.0.<i+1>."""

    def __init__(self, n, rate=None, latency="50ms", sysctls=None):
        if not 1 <= n <= 250:
            raise ValueError("hosts: 1..250, not %d" % n)
        self.n = n
        self.rate = rate
        self.latency = latency
        self.sysctls = dict(sysctls or {})  # per-namespace ones (net.*), set in every host
        self.prefix = _new_prefix()
        self.switch = self.prefix + "-sw"
        self.hosts = [Host(i, "%s-h%d" % (self.prefix, i), "pcnet%d" % i,
                           "%s.%d" % (SUBNET, i + 1)) for i in range(n)]
        self._created = []

    def __enter__(self):
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _add_namespace(self, ns):
        self._created.append(ns)  # first: a half-made one is deleted too
        _run([IP, "netns", "add", ns])

    def _build(self):
        self._add_namespace(self.switch)
        _run([IP, "-n", self.switch, "link", "add", BRIDGE, "type", "bridge"])
        _run([IP, "-n", self.switch, "link", "set", BRIDGE, "up"])
        for h in self.hosts:
            port = "port%d" % h.index
            self._add_namespace(h.netns)
            # Created directly in the two namespaces: no interface ever exists in the root one.
            _run([IP, "link", "add", h.ifname, "netns", h.netns, "type", "veth",
                  "peer", "name", port, "netns", self.switch])
            _run([IP, "-n", self.switch, "link", "set", port, "master", BRIDGE])
            _run([IP, "-n", self.switch, "link", "set", port, "up"])
            _run([IP, "-n", h.netns, "link", "set", "lo", "up"])
            _run([IP, "-n", h.netns, "addr", "add", "%s/%d" % (h.addr, PREFIX_LEN),
                  "dev", h.ifname])
            _run([IP, "-n", h.netns, "link", "set", h.ifname, "up"])
            for key, value in self.sysctls.items():
                path = "/proc/sys/" + key.replace(".", "/")
                _run(h.command([sys.executable, "-c",
                                "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                                path, str(value)]))
            if self.rate:
                _run(h.command([TC, "qdisc", "add", "dev", h.ifname, "root", "tbf",
                                "rate", self.rate, "burst", str(_burst_bytes(self.rate)),
                                "latency", self.latency]))
        self._wait_connected()

    def _wait_connected(self, timeout_s=10.0):
        """Waits until every host interface is up and every bridge port forwards."""
        deadline = time.monotonic() + timeout_s
        for h in self.hosts:
            while True:
                port = _run([IP, "-n", self.switch, "-d", "link", "show", "dev",
                             "port%d" % h.index], check=False)
                own = _run([IP, "-n", h.netns, "link", "show", "dev", h.ifname], check=False)
                if (port and own and "state forwarding" in port.stdout
                        and "LOWER_UP" in own.stdout):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("link of %s not up after %.0f s: %s %s" % (
                        h, timeout_s, port.stdout if port else "", own.stdout if own else ""))
                time.sleep(0.05)

    def close(self):
        """Kills what runs inside, deletes every namespace created. Idempotent; never raises."""
        for ns in reversed(self._created):
            try:
                _delete_namespace(ns)
            except Exception:  # noqa: BLE001 - teardown must go on with the rest
                pass
        self._created = []

    def describe(self):
        """One line per host and the link shaping, for logs and assertion messages."""
        shaping = ("egress tbf %s burst %d B latency %s" % (self.rate, _burst_bytes(self.rate),
                                                           self.latency)
                   if self.rate else "no shaping")
        shaping += "".join("; %s=%s" % kv for kv in sorted(self.sysctls.items()))
        return "; ".join("%s %s=%s/%d" % (h.netns, h.ifname, h.addr, PREFIX_LEN)
                         for h in self.hosts) + "; switch %s; %s" % (self.switch, shaping)


def torchrun_commands(hosts, python, script, script_args=(), nproc=1, port=29400,
                      run_id=None, extra_env=None):
    """One (host, argv, env) per host: torchrun there, joined through the c10d rendezvous
    hosted by host 0's agent at 198.18.0.1:<port>.

    Host 0 is told explicitly to host the rendezvous store (is_host=1, the others 0):
    torch's guess compares the endpoint with the machine's hostname, which every namespace
    shares, so it would not find 198.18.0.1 local. --local-addr gives each agent its own
    address, which the rank-0 agent publishes as MASTER_ADDR for the workers' store."""
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    run_id = run_id or "pycomm-%d-%d" % (os.getpid(), time.monotonic_ns())
    n = len(hosts.hosts)
    out = []
    for h in hosts.hosts:
        argv = [torchrun, "--nnodes=%d" % n, "--nproc-per-node=%d" % nproc,
                "--node-rank=%d" % h.index, "--max-restarts=0",
                "--rdzv-backend=c10d", "--rdzv-endpoint=%s:%d" % (hosts.hosts[0].addr, port),
                "--rdzv-id=%s" % run_id,
                "--rdzv-conf=is_host=%d,join_timeout=60" % (1 if h.index == 0 else 0),
                "--local-addr=%s" % h.addr,
                script] + [str(a) for a in script_args]
        env = dict(os.environ)
        # Gloo (for helper groups) would otherwise pick the address the shared hostname
        # resolves to, which no namespace has.
        env.update({"PYCOMM_SOCKET_IFNAME": h.ifname, "GLOO_SOCKET_IFNAME": h.ifname,
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        env.update(extra_env or {})
        out.append((h, h.command(argv), env))
    return out


# Lines worth keeping from the cut middle of a long output.
_KEY_LINE = re.compile(r"MISMATCH|Error|error:|FAILED|Traceback|[Tt]imed? ?out|Fatal|exited")


class JobResult:
    """How one host's command ended: exit status (None: stopped by us), and its output."""

    def __init__(self, host, argv, rc, output, stopped):
        self.host = host
        self.argv = argv
        self.rc = rc
        self.output = output
        self.stopped = stopped

    def describe(self, head_chars=4000, tail_chars=8000):
        """Exit status, command and output; a long output keeps its head (how the job
        started, the first error) and its tail (how it ended)."""
        out = self.output
        if len(out) > head_chars + tail_chars:
            middle = out[head_chars:-tail_chars]
            key = [line for line in middle.splitlines() if _KEY_LINE.search(line)][:40]
            out = "%s\n[... %d chars cut; the lines among them that look like errors:]\n%s\n" \
                  "[... end of cut ...]\n%s" % (out[:head_chars], len(middle), "\n".join(key),
                                                out[-tail_chars:])
        state = "stopped (deadline or another host failed)" if self.stopped else "exit %s" % self.rc
        return "---- host %d (%s), %s: %s\n%s" % (self.host.index, self.host.addr, state,
                                                 " ".join(self.argv[4:]), out)


def _stop_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_jobs(commands, timeout_s, grace_s=15.0):
    """Runs every (host, argv, env) of `commands` at once, each in a new session with its
    output in a temporary file, under one deadline of `timeout_s`. When one exits non-zero
    the others get `grace_s` more (so that their own errors are collected), then whatever
    still runs is stopped: SIGTERM to each session (torchrun then stops its workers, which
    sit in sessions of their own), SIGKILL after 5 s, and finally every process left inside
    the hosts' namespaces is killed by pid. Returns (results, timed_out)."""
    import tempfile

    procs = []
    try:
        for host, argv, env in commands:
            out = tempfile.TemporaryFile(mode="w+")
            procs.append((host, argv, out, subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while True:
            codes = [p.poll() for _, _, _, p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                timed_out = not any(c not in (None, 0) for c in codes)
                break
            time.sleep(0.1)
    finally:
        # Every exit path, including KeyboardInterrupt: nothing started here survives.
        stopped = set()
        for i, (_, _, _, p) in enumerate(procs):
            if p.poll() is None:
                stopped.add(i)
                _stop_group(p, signal.SIGTERM)
        end = time.monotonic() + 5.0
        while any(p.poll() is None for _, _, _, p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        for _, _, _, p in procs:
            if p.poll() is None:
                _stop_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for host in {h.netns for h, _, _, _ in procs}:
            _kill_inside(host)
    results = []
    for i, (host, argv, out, p) in enumerate(procs):
        out.seek(0)
        results.append(JobResult(host, argv, None if i in stopped else p.returncode,
                                 out.read(), i in stopped))
        out.close()
    return results, timed_out
