"""What runs inside one rank: the step in its fixed order (`trainer`), the comm hook and its
reductions (`comm`, `locate`), the plug-in interface injectors and detectors implement
(`plugins`), workloads, checkpoints and snapshots. Never imports launch, campaign or analysis."""
