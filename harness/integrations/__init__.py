"""The guard in the trainers people use: a Lightning callback (`harness.integrations.lightning`)
and a Hugging Face Trainer callback (`harness.integrations.transformers`), each an optional extra
(docs/guard.md)."""
