"""The detectors in your own training loop, DDP or FSDP2, in a few lines (docs/guard.md).

    from harness.guard import Guard, SDCAlarm

    model = DDP(model)                  # or fully_shard(...) on the blocks, then on the root
    code = 0
    with Guard(model, detectors="all", mode="act", replay_fn=loss_of,
               checkpoints="ckpt/") as guard:
        try:
            for step, batch in enumerate(loader):
                optimizer.zero_grad()
                guard.audit_batch(batch)                  # before the forward: what replay ships
                loss = guard.loss(loss_of(model, batch))  # checks see the loss; use what it returns
                loss.backward()                           # checks around the reduction
                guard.before_step()                       # every step; act mode raises SDCAlarm
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                guard.after_step(optimizer)               # checks on the updated weights
                if step % 100 == 99:                      # after after_step: the step ended
                    guard.save({"model": model.module.state_dict(),  # FSDP2: get_state_dict
                                "optimizer": optimizer.state_dict()})
        except SDCAlarm as alarm:
            code = alarm.exit_code                        # 86 suspect hardware, 87 not attributed
        else:
            guard.write_costs("costs.json")               # past warmup_steps: each check's cost
    sys.exit(code)

`detectors="all"` runs every check that applies to the model's parallelism, the comm hook, the
world and the arguments given (`guard.checks`; `guard.left_out` says why the others do not);
naming one that does not apply is refused when the Guard is built. A DDP module gets the
guard's comm hook, which reduces exactly as DDP's default allreduce (or the comm hook you pass,
`comm_hook=(state, hook)`, wrapped, not replaced), so a clean loop trains bit-identically to the
same loop without the guard. A `fully_shard` module (a 1-D mesh: FSDP; 2-D replicate x shard:
HSDP) gets the campaigns' sites on FSDP's own reduce-scatter, all-gather and HSDP all-reduce
(harness/runtime/sharding.py), bit-identical to plain `fully_shard` when clean; replay
recomputes on an unsharded copy of the module built from it. `inject={...}` (the keys of
`fault.*`) rehearses a fault in your loop: which check fires, when, naming which rank.

Replay ships the batch each rank trained on, with torch's random state before its forward, to the
rank one node back, which recomputes it with `replay_fn(model, batch) -> loss` on its own replica
under that state (so dropout draws the same masks; harness/runtime/batch_exchange.py). Under
gradient accumulation call `audit_batch` and `loss` for every micro-batch (those without a
reduction too) and backpropagate `loss / K`; replay recomputes all K. A loop that scales each
micro-batch's loss otherwise says how: `scale_loss=fn`, fn(loss, K) -> what it backpropagates.
A forward that does not reproduce even so (a non-deterministic op) is reported as a warning,
"not deterministic" (`guard.warnings`), not as an alarm against a rank.

Recovery (act mode, `checkpoints=FOLDER`): an alarm writes FOLDER/quarantine.json (suspect
machines, ranks, step, first suspect step, detector, evidence, exit code), sets aside the
checkpoints of the suspect interval (moved into `suspect/` beside them), and `save` refuses
from then on.
EXIT_SUSPECT_HARDWARE (86) when the alarm names machines (restart without them),
EXIT_UNATTRIBUTED (87) when it names none or all of them. On restart, `Guard.restore_point(FOLDER)`
gives the newest checkpoint the checks approved before the suspect interval
(harness/campaign/recovery.py), and `Guard(..., start_step=step + 1)` resumes the count.

Ending: an alarm detaches the guard before it is raised (`close()`), and `close()` (or leaving
the `with` block) does so otherwise: hooks removed, and every tensor the checks handed to a
collective released once the backend has let go of it (harness/core/inflight.py), so the loop may
then destroy the process group and return or exit however it likes.

Costs: `guard.costs()` (this rank) and `guard.write_costs(path)` (every rank together; each
part's mean over the ranks, as JSON) give what each check cost per step in this job, the hook's own
cost, and the loop's step, over the steps after `warmup_steps`: time on the CPU, device time
from timing events on an accelerator (nothing waits for them inside a step).
`sdc-plan RUN --costs FILE` prices the plan with them.

Node identity: ranks_per_node from the argument, else SDC_RANKS_PER_NODE, else torchrun's
LOCAL_WORLD_SIZE; a machine name from SDC_NODE_NAME (else the host name; `{node}` in it is
replaced by the node index, which simulates nodes on one host for a rehearsal), so an alarm
names machines, not only rank numbers.
"""

from harness.guard.alarm import EXIT_SUSPECT_HARDWARE, EXIT_UNATTRIBUTED, SDCAlarm
from harness.guard.guard import Guard

__all__ = ["EXIT_SUSPECT_HARDWARE", "EXIT_UNATTRIBUTED", "Guard", "SDCAlarm"]
