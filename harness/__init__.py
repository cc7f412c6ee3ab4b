"""sdc-bench's harness, in sub-packages that follow a campaign's data flow (docs/design.md,
section 3; the house tour in docs/contributing.md):

    config -> campaign -> launch -> runtime (inside each rank) -> results -> analysis

`harness.guard` (the checks in a user's own loop), `harness.cli` (`sdc-bench`) and
`harness.torchrun_worker` are the entry points; the installed commands start in `harness.entry`.
Which package may import which is written down in pyproject.toml ([tool.importlinter]) and
checked by the test command. No package imports anything here, so importing one sub-module stays
cheap.
"""
