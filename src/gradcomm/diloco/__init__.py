"""Low-communication training: DiLoCo, Streaming DiLoCo and SparseLoCo (:class:`DiLoCo`).

**DiLoCo** (Douillard et al. 2023, arXiv 2311.08105). Every worker runs ``H`` (``sync_every``) steps of its
own *inner* optimizer (AdamW in the paper) without communicating. Then the workers average their
*pseudo-gradients* (the parameters at the last sync, the *anchor*, minus the parameters now) and one *outer*
optimizer (SGD with Nesterov momentum 0.9, learning rate 0.7) updates the anchor, which every worker takes as
its new parameters. Communication falls by a factor ``H`` against data-parallel training.

**Defaults** (``sync_every=50``, ``outer_lr=1.0``, ``outer_momentum=0``: plain averaging of the replicas every
50 steps) were chosen by measurement, not taken from the paper: on the bench's transformer with 2 ranks
trained from scratch, plain averaging every 25-50 steps ended within about 1% of allreduce's loss after 4000
steps, while every larger outer step (learning rate above 1, or Nesterov momentum; the paper's lr 0.7 with
momentum 0.9 worst of all, +28% at 2000 steps) was worse, and syncing every 100 steps cost +6%. 50 rather
than 25 halves the bytes for a gap that closes with training length (docs/notes/2026-11-27-diloco-defaults-and-targets.md):
on text never repeated they ended within 1% of allreduce's loss on four seeds of 8000 steps, from +3.1% at 4000
(docs/notes/2026-11-28-diloco-unrepeated-corpus.md). The
paper's setting (8 workers, ``H = 500``, from a pretrained model) is ``sync_every=500, outer_lr=0.7,
outer_momentum=0.9`` (Nesterov is on whenever the momentum is). A run of fewer than about 20 syncs, or a
rapidly changing loss, favours a smaller ``sync_every``; a compressor (``compressor="qsgd"``, 4 bits)
multiplies the saving by about 8 at no measured loss.

**Streaming DiLoCo** (Douillard et al. 2025, arXiv 2501.18512). ``fragments=F`` lays the parameters end to end
(registration order) and cuts them into ``F`` contiguous ranges of ``N / F`` elements: at the nearest row
boundary by default (``fragment_unit="row"``: each part of a cut parameter is whole rows of it), exactly
(``"element"``), or between whole parameters only (``"parameter"``, as before fragments could cut one: a
dominant tensor then sets the peak); see :mod:`gradcomm.diloco.fragments`. Fragment ``f`` syncs at the inner
steps ``t`` with ``(t + f * H // F) % H == 0``, so the peak bandwidth falls by ``F``. Each fragment's outer
step is DiLoCo's on its elements: its pseudo-gradients averaged, the outer optimizer stepped on its range of
the anchors (one optimizer parameter per part, a view of the parameter's anchor: per element the same as
before for an elementwise optimizer such as SGD with momentum; a per-tensor one, LARS or LAMB, would see parts
as tensors), its parameters reset to them. ``overlap=tau`` lets an exchange run behind the next ``tau`` inner
steps: it is launched at the sync step and its outer update applied ``tau`` steps later (the
"eager"/overlapped variant; arXiv 2502.12996 studies the overlap). The synced fragment then becomes ``mixing *
local + (1 - mixing) * global``: Streaming DiLoCo's mixing with ``alpha = mixing``; the default 0 replaces the
local values by the new global ones, so that the replicas are identical again right after the sync (with
``mixing > 0`` they never are, and the replica check is off). Streaming DiLoCo's low-bit pseudo-gradients: a
quantizing hook, ``compressor="qsgd"`` (4 bits: 7 levels and a sign) or ``"quantize_per_tensor"`` (8 bits).

**SparseLoCo** (arXiv 2508.15706): top-k at 1-3% density with error feedback and 2-bit quantisation of the
pseudo-gradients, ``compressor="sparseloco"`` (:mod:`gradcomm.compression.methods.sparseloco`: per chunk of
4096 values of a tensor its 64 largest, each a sign and one of the chunk's two magnitudes, from an
accumulator decayed by ``ef_decay=0.95``), with the default outer step: the paper replaces outer momentum by
that accumulator and averages plainly. Its accumulators live in the hook state, keyed by parameter, and are
checkpointed, by parameter, or by ``name[start:stop]`` for the part of a cut parameter; any other compression
method with error feedback works the same way (``"topk:ratio=0.02"``).

The outer exchange is the DDP hook machinery: each fragment's pseudo-gradients are flattened per dtype into
:class:`~gradcomm.GradBucket` buffers and reduced by the averaging allreduce or by the ``compressor`` hook
(a registry name with options, a callable returning a ``(state, hook)`` pair, or such a pair), with the DDPs'
failure handling and telemetry (:meth:`DiLoCo.comm_stats`: one "step" per fragment sync). Each fragment's
exchange is one iteration of a hook state of its own, so stateful compressors get one state per fragment (a
single stateful pair is refused with ``fragments > 1``). Exchanges that overlap in time (``fragments *
overlap >= sync_every``) through a hook wait for each other, since a hook's later stages are ordered only
among its own state's calls.

Usage::

    model = MyModel()                                  # the same seed on every rank; DiLoCo broadcasts anyway
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    diloco = gradcomm.DiLoCo(model, inner)            # plain averaging every 50 steps; see Defaults
    for inputs, targets in loader:                     # each rank its own shard
        loss_fn(model(inputs), targets).backward()
        diloco.step()                                  # inner step; every H steps (per fragment) the outer sync
        diloco.zero_grad()
    gradcomm.save_checkpoint(path, model, inner, diloco, step=diloco.inner_steps)
    ...
    gradcomm.load_checkpoint(path, model, inner, diloco)   # the resumed run equals the uninterrupted one

Wrapped in a DDP (``gradcomm.DiLoCo(DistributedDataParallel(model, ...), inner)``), the DDP averages the
gradients every step within its group (e.g. a host) and DiLoCo works across the groups, each DDP's group one
replica: by default only each replica's first rank exchanges, over the group of those first ranks (made at
construction from the DDPs' groups, which must split the ranks into disjoint replicas), and then broadcasts
the averaged pseudo-gradients (and the synced buffers) inside its DDP's group. So the link between hosts
carries one copy of each host's pseudo-gradients per sync, not one per rank, the host's other ranks wait
for the broadcast, and a compressor's state advances on the first ranks only (the hierarchical hook's
layout, :mod:`gradcomm.hooks.hierarchical_hook`). The outer update is that of DiLoCo over the replicas,
whose ranks all end each sync identical. ``process_group=`` instead makes every rank exchange over the group
it is given (:func:`gradcomm.diloco.groups.across_nodes_group`: the ranks of the same local rank on every
node, each node then sending one copy per rank), its DDP group's first rank's result kept.
``anchor_device="cpu"`` keeps the anchors and the outer optimizer's state off the accelerator.

Guarantees: constructing a DiLoCo is a collective that broadcasts the parameters from the group's first rank
and compares the setup (``sync_every``, ``fragments``, ``overlap``, ``mixing``, the outer optimizer, the
fragment layout, the compressor and its options) across the ranks, which all raise
:class:`~gradcomm.RanksDisagreeError` if it differs. Right after every outer sync, the synced fragment is the
same on every rank to the bit, checked with one small all-gather (``check_replicas=False`` turns it off);
between syncs the replicas differ on purpose (:meth:`DiLoCo.replicas_may_differ`). A peer lost during an outer
exchange raises :class:`~gradcomm.PeerLostError` (a failing compressor :class:`~gradcomm.CommHookError`) on
every rank within the process group's timeout (a replica's other ranks, waiting for its first rank's
broadcast, with PeerLostError); the anchors (:meth:`DiLoCo.synced_parameters`, and
:meth:`DiLoCo.state_dict`) still hold the last synced parameters, and the DiLoCo refuses further steps.
:meth:`DiLoCo.state_dict` holds the counters and each fragment's parts (the fragment schedule), the anchors,
the outer optimizer, the compressor's state and any exchange in flight, in tensors and plain values
(``torch.load(..., weights_only=True)``), so a resumed run equals the uninterrupted one bit for bit. Buffers
(batch-norm statistics) are averaged at every sync of fragment 0 (see :mod:`gradcomm.diloco.buffers`), so
right after it they too are the same on every rank (:meth:`DiLoCo.synced_buffers`); in a DDP, the buffers
averaged are those of the DDP group's first rank (which a DDP broadcasting its buffers at every forward, the
default, gives the group's other ranks at their next forward anyway).
"""

from gradcomm.diloco.core import DiLoCo

__all__ = ["DiLoCo"]
