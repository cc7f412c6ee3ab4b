"""Reading finished runs: the report (`sdc-report`), figures, regressions (`sdc-regress`), sweeps
and the planner (`sdc-plan`). Imports only the results schema: it never needs torch or a world."""
