"""The CUDA MPS control daemon: started around a step whose processes share the GPU, and
stopped by the orchestrator after every step (a step killed at its limit may leave it)."""
import os
import shutil
import subprocess
import tempfile

# The MPS daemon's pipes and log: a directory of this check's own, so that the orchestrator
# can stop a daemon that a step killed at its limit left running.
MPS_DIR = os.path.join(tempfile.gettempdir(), "pycomm-gpu-check-mps")
MPS_ENV = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(MPS_DIR, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(MPS_DIR, "log")}


def stop_mps():
    if os.path.isdir(MPS_DIR) and shutil.which("nvidia-cuda-mps-control"):
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=dict(os.environ, **MPS_ENV), timeout=30,
                       capture_output=True)
        shutil.rmtree(MPS_DIR, ignore_errors=True)


class daemon:
    """The CUDA MPS control daemon for the duration (the spawned ranks inherit its
    variables); yields what ran."""

    def __init__(self):
        self.env, self.started = MPS_ENV, False

    def __enter__(self):
        control = shutil.which("nvidia-cuda-mps-control")
        if not control:
            return "time-sliced (no nvidia-cuda-mps-control)"
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        rc = subprocess.run([control, "-d"], env=dict(os.environ, **self.env), timeout=30).returncode
        if rc != 0:
            return "time-sliced (the MPS daemon did not start: exit %d)" % rc
        os.environ.update(self.env)
        self.started = True
        return "MPS"

    def __exit__(self, *exc):
        if self.started:
            stop_mps()
            for k in self.env:
                os.environ.pop(k, None)

