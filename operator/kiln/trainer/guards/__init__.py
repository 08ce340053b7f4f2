"""Training-health guards: never take an optimizer step on garbage, never commit corrupted weights.

Two hooks the training loop calls, in this order, after backward and gradient clipping:

    decision = step_guard.check(step, loss, grad_norm)      # pure: same inputs → same decision on every rank
    if decision.action is Action.SKIP:     optimizer.zero_grad(); continue
    if decision.action is Action.ROLLBACK: reload the last COMMITTED checkpoint, skip decision.skip_data
    optimizer.step()
    if sdc.due(step): sdc.verify(model, step, loss=global_loss)   # raises before the step can be committed

`StepGuard` is pure Python (no torch): give it the *global* loss and grad norm (`global_scalars`
all-reduces them, so a NaN on any rank becomes a NaN on every rank and all ranks decide alike).
`SdcCheck` hashes the bits of every parameter on device and makes two comparisons:
- replicas (`verify`): between the ranks that must hold identical copies: for DTensor parameters
  (FSDP2/HSDP, TP) the ranks along the mesh dimensions whose placement is `Replicate()`; for plain tensors
  (DDP) every rank of the given group. Plain FSDP has no such copy.
- the seal (`seal` after one step's update, `verify_seal` before the next one's): every rank's own shards
  and optimizer state against their fingerprint from the previous update, which every rank of the job
  holds. Nothing may change them in between (forward and backward only read them), so this checks every
  layout, plain FSDP included, and names the exact rank.
"""
