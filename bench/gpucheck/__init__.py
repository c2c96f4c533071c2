"""The GPU check's parts (bench/gpu_check.py is its command line and plan): orchestrate (the
steps as child processes with limits, a budget and interrupts), mps (the MPS daemon), steps
and graphs (the measuring steps), report (the Markdown summary), common (what they share)."""
