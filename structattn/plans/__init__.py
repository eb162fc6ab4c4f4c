"""The plan compiler's parts (``structattn.compiling.replay`` decides per call which runs):

- ``plan``: a ``Plan``, how a tensor's values are named between calls (``stamp``, ``hold``),
  and ``replay``, which runs a plan's graph and reads (or, on a GPU, queues) its checks;
- ``record``: one reading traced by ``make_fx`` into a plan;
- ``simplify``: the graph rewrites, each keeping every value bit for bit, and the split of
  what depends on the parameters alone;
- ``fast_path``: the function generated for the plan a module replayed last.
"""
