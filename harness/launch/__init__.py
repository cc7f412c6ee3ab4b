"""Worlds of rank processes: the spawned simulation (`world`, `rank_server`), torchrun's world
(`torchrun_world`, `torchrun_worker`), the kernel pins every rank starts with (`environment`),
and the stack dumps that make a hang explain itself (`stacks`)."""
