"""The value and argument checks every module shares: switchable value checks (``_validation``),
checks queued on a GPU (``verdicts``), the output's batch dims (``output_batch``) and the
arguments no longer taken, refused in one line (``renamed``)."""
