"""Pure planning and simulation of pipeline schedules (no torch): the discrete-event simulator
(``simulate``, ``timeline``, ``baselines``) and the partition search that ranks plans by it.

The running engine (``engine.parallel``) uses the search when it re-plans from measured times;
the job planner (``engine.planner``) uses the simulator to predict throughput.
"""
