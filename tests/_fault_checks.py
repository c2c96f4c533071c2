"""Checks shared by the fault tests (test_fault_matrix.py, test_cuda.py): what an error
message must say per docs/design.md, 'Fault model', and how a poisoned group must behave.

Rank side: first_lines, second_call. Test side: contract_problems, sticky_problems.
"""

import re
import time

from _harness import is_gloo

# A poisoned group must refuse the next call within this many seconds.
FAIL_FAST_S = 1.0


def first_lines(exc, n=4):
    return " | ".join(str(exc).strip().splitlines()[:n])[:1500]


def second_call(t):
    """After the first error: the poisoned group must refuse at once, naming the cause."""
    return timed_all_reduce(t)


def timed_all_reduce(t, group=None):
    """dist.all_reduce(t): whether it raised, after how long, and the message's first lines."""
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        return {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "elapsed": time.monotonic() - t0, "msg": first_lines(e)}


def contract_problems(msg, peer_pattern, op="allreduce", seq=None):
    """What the error message lacks per the contract: pycomm, the operation, its sequence
    number ("#<seq>", any when seq is None) and the peer (pycomm only: gloo words it its way)."""
    if is_gloo():
        return []
    problems = []
    if "pycomm" not in msg.lower():
        problems.append("no 'pycomm'")
    if op not in msg.lower() and op.replace("all", "all_", 1) not in msg.lower():
        problems.append("no operation name %r" % op)
    if not re.search(r"#%s\b" % (r"\d+" if seq is None else seq), msg):
        problems.append("no sequence number '#%s'" % ("<n>" if seq is None else seq))
    if not re.search(peer_pattern, msg):
        problems.append("no peer matching %r" % peer_pattern)
    return problems


def sticky_problems(rank, second, cause_pattern):
    """What is wrong with the call after the first error (see second_call)."""
    if not second["raised"]:
        return ["rank %d: a second all_reduce on the failed group did not raise" % rank]
    problems = []
    if second["elapsed"] >= FAIL_FAST_S:
        problems.append("rank %d: second all_reduce took %.2fs to fail (bound %ss)"
                        % (rank, second["elapsed"], FAIL_FAST_S))
    if not re.search(cause_pattern, second["msg"], re.IGNORECASE):
        problems.append("rank %d: second error does not name the original cause (%r): %r"
                        % (rank, cause_pattern, second["msg"]))
    return problems
