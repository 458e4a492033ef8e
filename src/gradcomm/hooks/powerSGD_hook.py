"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019, https://arxiv.org/abs/1905.13727).

The same algorithm, options and results as ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``,
for torch's DistributedDataParallel or gradcomm's.

The algorithm
-------------
A gradient matrix ``M`` (``n x m``; a higher-dimensional tensor is viewed as ``shape[0] x rest``) is replaced
by a rank-``r`` approximation ``P Q^T`` found by one step of power iteration, with two small allreduces:

1. ``Q`` (``m x r``) is orthonormalized; ``P = M Q`` (``n x r``) is computed and summed over the ranks;
2. ``P`` is orthonormalized; ``Q = M^T P`` is computed and averaged over the ranks;
3. every rank decompresses ``P Q^T``, which approximates the averaged gradient.

Since the ``P`` and ``Q`` sums are linear in ``M``, the result is the approximation of the *average*
gradient, the same on every rank. Instead of ``n * m`` numbers a rank sends ``(n + m) * r``.

* **When tensors go uncompressed.** A matrix is compressed only when that saves enough:
  ``(n + m) * r * min_compression_rate < n * m``. Vectors (biases, norms), scalars and small or thin
  matrices fail the test; they are concatenated and averaged by one plain allreduce. For the first
  ``start_powerSGD_iter`` iterations nothing is compressed: the whole bucket is averaged, as without a hook.
  Early training is the most sensitive to gradient error, and DDP rebuilds its buckets after the first
  iteration, which must happen before any per-bucket state is kept.
* **Error feedback** (``use_error_feedback``). PowerSGD is biased: what the approximation misses is kept
  per rank and added to the next step's gradient, so nothing is lost, only delayed. The sum of the applied
  updates equals the sum of the true averaged gradients minus the ranks' mean current error, which stays
  bounded. It costs one gradient-sized buffer per bucket, which also holds ``gradient + error`` while the
  bucket is compressed (torch additionally copies the whole input every step). The error is kept per
  parameter (views into that buffer), so it follows its parameter into whatever bucket holds it.
* **Warm start** (``warm_start``). ``Q`` is kept from one step to the next instead of drawn afresh, so the
  single power-iteration step per training step keeps refining the same subspace. It costs the ``Q``
  matrices (``m * r`` per compressed matrix); ``P`` is recomputed every step and is not kept.

Random ``Q`` come from a NumPy generator seeded with ``random_seed``: every rank draws the same values.

:func:`batched_powerSGD_hook` views the whole bucket as one zero-padded square matrix instead of per-layer
matrices: less compute and one matrix per bucket, but mixing unrelated layers in one matrix destroys most of
the low-rank structure, so accuracy is usually much worse unless ``matrix_approximation_rank`` is 1.

Trade-offs
----------
Higher ``matrix_approximation_rank`` approximates better but costs more communication and compute (the
orthonormalization switches from Gram-Schmidt to QR above rank 2). Later ``start_powerSGD_iter`` trades
communication savings for accuracy. Error feedback and warm start are recommended; each costs memory.
``batch_tensors_with_same_shape`` runs one batched matrix product per shape instead of one per matrix:
faster with many same-shaped layers, at the cost of a stacked copy of them.

Differences from torch's implementation (otherwise the same results, bit for bit for :func:`powerSGD_hook`)
------------------------------------------------------------------------------------------------------------
* Error feedback holds one gradient-sized buffer per bucket; no copy of the input is made.
* State is keyed by parameter (its name, or its order of first appearance: see
  :mod:`gradcomm.hooks.parameter_keys`), not by bucket index, so a checkpoint resumes whatever the bucket
  layout of the resumed DDP (torch's DDP starts a resumed process in its initial layout). For
  :func:`batched_powerSGD_hook` the warm-start ``Q`` (and the padding's error) belong to the bucket's
  parameters in their order; a bucket of other parameters draws its ``Q`` afresh.
* Columns of zeros (vanishing gradients) stay zero instead of becoming NaN when
  ``orthogonalization_epsilon`` is 0. A warm-start ``Q`` column that has become zero is drawn afresh: in
  torch's a layer whose gradient was exactly zero in one step (a branch not used yet) stays at zero, or
  NaN, for the rest of training.
* :func:`batched_powerSGD_hook` works (torch 2.13's fails on a 2-D ``_orthogonalize`` check), honours
  ``orthogonalization_epsilon`` (torch's ignores it), and matches torch's up to rounding: it multiplies out
  the rows holding the zero padding separately instead of padding the bucket.
* On two ranks, ``P`` and the uncompressed tensors (biases, norms) travel in one allreduce; torch's hook
  allreduces the uncompressed tensors first and ``P`` after them. The sums are the same bit for bit (a sum
  of two values is one addition, which is commutative), with one collective per bucket fewer. On three or
  more ranks they stay apart, as in torch's: the ring orders an element's additions by its offset, so
  sharing one buffer would change the last bits.
* ``P`` is not kept between steps (torch keeps a ``p_memory_dict`` whose contents every step overwrites).
* No waiting inside callbacks, and one order of collectives on every rank. A collective that needs an
  earlier one's result is launched from that one's callback, but all of a state's collectives are launched
  in the order DDP called the hook. The call for the last bucket of an iteration returns only once the
  iteration's collectives are all launched (DDP waits for them right after anyway), so that collectives DDP
  issues after the last bucket (the used-parameter map of ``find_unused_parameters=True``) come after them.
  Torch's hooks wait inside gloo callbacks, which deadlocks gloo's worker threads, and launch from whichever
  thread gets there first, which pairs different collectives across ranks: on gloo they fail or hang once a
  model has several buckets, or with ``find_unused_parameters=True``.
* A loaded state is checked against the model in its first compressed iteration and refused, naming the
  parameter, when it holds a parameter of another shape or one the model's buckets do not hold, or keys of
  the other kind (names against first-appearance order); torch silently adds a saved error of the same
  length.
* ``state_dict()`` holds only tensors and plain values (``torch.load(weights_only=True)`` loads it).
"""

# The implementation lives in gradcomm.hooks.powersgd (state, kernel, hook); this module is torch's import path.
from gradcomm.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
