"""The one place that decides which backends run: `choose_expert_backend` (the expert FFN),
`choose_expert_exchange` (how expert parallelism moves tokens), `choose_attention_backend` and
`choose_unembedding_form` (the loss's matmul form), `choose_loss_impl` (fused kernel or chunked scan) and
`choose_layer_loop` (how a stack of layers is iterated).

Every caller asks this function: `ModelConfig` validates `expert_impl` against `EXPERT_IMPLS`, the MoE
layer and `expert_ffn` resolve through it, and the ahead-of-time compile report asks it for a TPU
platform. The module imports nothing heavy at import time (the config imports it), and nothing from
`smelt_jax.model`.

Rules:
- `auto` picks by platform: TPU -> `pallas` (the project's Mosaic kernels), GPU -> `ragged_dot`, anything
  else (CPU) -> `tiled` (the dropless tiled grouped matmul; measured in docs/kernels.md).
- Mosaic kernels (`pallas`, `megablox`) cannot be partitioned by GSPMD ("Mosaic kernels cannot be
  automatically partitioned"). On a mesh of more than one device they only run inside the
  expert-parallel exchange, which the MoE layer takes when the mesh's `expert` axis is larger than 1 (each
  device then runs the kernel on its own experts). On any other multi-device mesh they become
  `ragged_dot`, XLA's partitionable grouped matmul.
- The expert exchange `auto` is `padded` (`all_to_all` of the whole load-sized buffers) on TPU and CPU,
  and `ragged` (`jax.lax.ragged_all_to_all`: only the filled rows travel) on GPU. CPU's XLA lacks
  ragged-all-to-all. On TPU both compile; since the buffers are sized by load (slack 1.5 then, 2.5
  since issue 41; docs/moe-buffers.md) the padded exchange sends at most ~slack x the filled rows over ICI, while the TPU
  compiler's ragged-all-to-all pads each row to a multiple of 256 bf16 lanes (576 -> 768) and adds
  layout copies around it: 100M S95 SMELT on v5p-128 walks 880 GB per device per step with `ragged`,
  696 GB with `padded` (roofline step 0.358 -> 0.296 s; docs/performance.md).
- `ring` (model/ring_exchange.py) all-gathers the tokens over `expert` and reduce-scatters the combined
  outputs instead of the two all-to-alls; never `auto`'s choice: the compile report's layout search picks
  it per configuration where its roofline bound is lower (recorded as the layout's `exchange`).
- Pallas kernels run interpreted or compile to Mosaic by the target being traced for
  (`pallas_interpret`), never by `jax.default_backend()`, which is the CPU during an ahead-of-time compile.
- Attention `auto` is `splash` (Pallas splash attention, causal block skipping: `kernels/splash.py`) on
  TPU for a full forward whose row length is a multiple of its blocks; `blocked` (the reference's
  arithmetic over query blocks of CAUSAL_BLOCK rows, each against the keys up to its end:
  `model.attention.causal_blocked_attention`) on CPU for a full forward, where the masked half of the
  score matrix was half the attention's time (core fwd + bwd at the issue-17 shapes 41.5 -> 20.5 ms); and
  `reference` (the masked dense `model.attention.dot_product_attention`, the test oracle) everywhere
  else: decoding, captured probabilities, GPU. The CPU is read from the traced mesh as for the
  unembedding form, so an ahead-of-time TPU compile on this CPU never gets `blocked`.
- The unembedding + cross-entropy (`model/loss.py`) multiplies `einsum` over [batch, seq, ...] on TPU
  and GPU, and `matmul` on 2-D [batch * seq, ...] operands on CPU: there the einsum's weight gradient
  makes a transposed copy (145 vs 76 ms at the issue-17 shapes), while on TPU the 2-D form raised the
  temporaries of smelt16 (20.6 -> 24.2 GiB on v5p-128). The platform is the traced mesh's when it names
  one (an ahead-of-time TPU compile traces on the CPU under a TPU mesh).
- The loss itself (`choose_loss_impl`) is the fused Pallas linear cross-entropy (kernels/fused_ce.py) on
  TPU, run per device in a shard_map, and the chunked scan above elsewhere (CPU speed unchanged).
- A stack of layers (and the loop's visits) runs as a `lax.scan` on TPU and GPU (one compiled body for
  any depth) and as a Python loop (`unrolled`) on CPU: there the scan's stacked per-layer residuals are
  zero-filled and written with dynamic-update-slices and its weights read with dynamic slices, 16% of the
  issue-17 step's thunk time; unrolled, the step took 0.90x the scan's time (median of 15 paired rounds,
  all 15 below 1) and the micro-m SMELT step 0.875x (9 of 9), at no extra compile time at 4-9 layers
  (docs/performance.md). The platform is read as for the unembedding form.
"""

from __future__ import annotations

EXPERT_BACKENDS = ("dense", "ragged_dot", "megablox", "capacity", "pallas", "tiled")
EXPERT_IMPLS = ("auto",) + EXPERT_BACKENDS  # valid `ModelConfig.expert_impl` values
AUTO_BACKEND = {"tpu": "pallas", "gpu": "ragged_dot", "cpu": "tiled"}
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
MOSAIC_BACKENDS = ("pallas", "megablox")
GSPMD_BACKEND = "ragged_dot"
EXPERT_EXCHANGES = ("auto", "padded", "ragged", "ring")  # valid `ModelConfig.expert_exchange` values
AUTO_EXCHANGE = {"tpu": "padded", "gpu": "ragged", "cpu": "padded"}
ATTENTION_IMPLS = ("auto", "reference", "splash", "blocked")  # valid `ModelConfig.attention_impl` values
SPLASH_SEQ_MULTIPLE = 128  # splash needs rows in whole blocks of a multiple of 128 keys (kernels/splash.py)
CAUSAL_BLOCK = 64  # query rows per block of the CPU's `blocked` attention
UNEMBEDDING_FORMS = ("einsum", "matmul")
AUTO_UNEMBEDDING_FORM = {"tpu": "einsum", "gpu": "einsum", "cpu": "matmul"}
LOSS_IMPLS = ("auto", "chunked", "fused")  # valid `unembed_cross_entropy(impl=...)` values
AUTO_LOSS_IMPL = {"tpu": "fused", "gpu": "chunked", "cpu": "chunked"}
LAYER_LOOPS = ("auto", "scan", "unrolled")  # valid `Decoder.layer_loop` values
AUTO_LAYER_LOOP = {"tpu": "scan", "gpu": "scan", "cpu": "unrolled"}
EXPERT_AXIS = "expert"  # the mesh axis experts are sharded over (smelt_jax.parallel.sharding.MESH_AXES)


def _axis_size(mesh, axis: str) -> int:
    return int(dict(mesh.shape).get(axis, 1))


def expert_axis_size(mesh) -> int:
    """Size of the mesh's `expert` axis; 1 without a mesh (None or empty)."""
    if mesh is None or getattr(mesh, "empty", False):
        return 1
    return _axis_size(mesh, EXPERT_AXIS)


def _platform(platform: str | None) -> str:
    """'cpu', 'gpu' or 'tpu'; None = JAX's default backend."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return _PLATFORM_ALIASES.get(platform, platform)


def pallas_interpret(interpret: bool | None = None) -> bool:
    """Whether a Pallas kernel traced now runs in interpret mode. An explicit bool is returned as is;
    None means: Mosaic (False) when tracing for a TPU, interpret (True) otherwise.

    "Tracing for a TPU" is read from the compile target, not from `jax.default_backend()`: the abstract
    mesh's device kind under `jax.set_mesh(mesh)` (the compile-only devices of an ahead-of-time topology
    included), else the default device's (a TPU host). Every Pallas kernel of the project asks this.
    """
    if interpret is not None:
        return bool(interpret)
    from jax.experimental.pallas import tpu as pltpu

    return not pltpu.is_tpu_device()


def choose_expert_exchange(requested: str, platform: str | None = None) -> str:
    """'padded', 'ragged' or 'ring' for `requested` (a name in EXPERT_EXCHANGES); only `auto` reads `platform`
    ('cpu', 'gpu', 'tpu'; None = JAX's default backend)."""
    if requested not in EXPERT_EXCHANGES:
        raise ValueError(f"expert exchange {requested!r} not in {EXPERT_EXCHANGES}")
    if requested != "auto":
        return requested
    return AUTO_EXCHANGE.get(_platform(platform), AUTO_EXCHANGE["cpu"])


def choose_attention_backend(requested: str, platform: str | None = None, *, seq_len: int | None = None,
                             full_forward: bool = True, mesh=None) -> str:
    """'reference', 'splash' or 'blocked' for `requested` (a name in ATTENTION_IMPLS).

    For a full forward (no KV cache, no captured probabilities) `auto` is 'splash' on TPU over rows of
    `seq_len` keys, a multiple of SPLASH_SEQ_MULTIPLE, and 'blocked' on CPU (platform None: `mesh`'s
    devices' when it names them, else JAX's default backend; rows longer than one CAUSAL_BLOCK). An
    explicit 'splash' or 'blocked' is honoured for a full forward (splash on CPU runs in Pallas
    interpret mode: tests only); anything else is 'reference'.
    """
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {requested!r} not in {ATTENTION_IMPLS}")
    if not full_forward:
        return "reference"
    if requested == "auto":
        if _traced_platform(platform, mesh) == "cpu":
            return "blocked" if seq_len is None or seq_len > CAUSAL_BLOCK else "reference"
        fits_blocks = seq_len is not None and seq_len % SPLASH_SEQ_MULTIPLE == 0
        return "splash" if _platform(platform) == "tpu" and fits_blocks else "reference"
    return requested


def choose_unembedding_form(platform: str | None = None, mesh=None) -> str:
    """'einsum' or 'matmul': the form of the unembedding's matmuls (model/loss.py) on `platform`.

    platform None: the platform of `mesh`'s devices when the mesh names one (an AbstractMesh from
    `jax.set_mesh` over TPU devices says 'tpu' even while this machine's backend is the CPU), else JAX's
    default backend.
    """
    return AUTO_UNEMBEDDING_FORM.get(_traced_platform(platform, mesh), AUTO_UNEMBEDDING_FORM["cpu"])


def choose_loss_impl(requested: str = "auto", platform: str | None = None, mesh=None) -> str:
    """'fused' or 'chunked' for `requested` (a name in LOSS_IMPLS): how `model.loss.unembed_cross_entropy`
    runs. `auto` is 'fused' (the Pallas kernels of kernels/fused_ce.py, whose f32 logits never reach HBM)
    on TPU and 'chunked' (the sequence-chunked XLA scan) elsewhere: on CPU the kernel would run
    interpreted. The platform is found as in `choose_unembedding_form`."""
    if requested not in LOSS_IMPLS:
        raise ValueError(f"loss impl {requested!r} not in {LOSS_IMPLS}")
    if requested != "auto":
        return requested
    return AUTO_LOSS_IMPL.get(_traced_platform(platform, mesh), AUTO_LOSS_IMPL["cpu"])


def choose_layer_loop(requested: str = "auto", platform: str | None = None, mesh=None) -> str:
    """'scan' or 'unrolled' for `requested` (a name in LAYER_LOOPS); only `auto` reads the platform,
    which is found as in `choose_unembedding_form`."""
    if requested not in LAYER_LOOPS:
        raise ValueError(f"layer loop {requested!r} not in {LAYER_LOOPS}")
    if requested != "auto":
        return requested
    return AUTO_LAYER_LOOP.get(_traced_platform(platform, mesh), AUTO_LAYER_LOOP["cpu"])


def _traced_platform(platform: str | None, mesh) -> str:
    """`platform`, else the platform of `mesh`'s devices when the mesh names one, else JAX's default."""
    if platform is None and mesh is not None and not getattr(mesh, "empty", False):
        device = getattr(mesh, "abstract_device", None)
        platform = getattr(device, "platform", None)
    return _platform(platform)


def choose_expert_backend(requested: str, platform: str | None = None, mesh=None) -> str:
    """The backend that runs for `requested` (a name in EXPERT_IMPLS).

    platform: 'cpu', 'gpu' ('cuda', 'rocm'), 'tpu'; None = JAX's default backend. Only `auto` reads it.
    mesh: the mesh the layer is traced under (a Mesh, an AbstractMesh, or None / empty for none). With
      more than one device and an `expert` axis of size 1, Mosaic backends become GSPMD_BACKEND.
    """
    if requested not in EXPERT_IMPLS:
        raise ValueError(f"expert impl {requested!r} not in {EXPERT_IMPLS}")
    backend = requested
    if requested == "auto":
        backend = AUTO_BACKEND.get(_platform(platform), AUTO_BACKEND["cpu"])
    if backend in MOSAIC_BACKENDS and _gspmd_partitioned(mesh):
        return GSPMD_BACKEND
    return backend


def _gspmd_partitioned(mesh) -> bool:
    """True when the expert computation would be split by GSPMD: a mesh of more than one device whose
    `expert` axis is 1 (with an expert axis the layer runs the kernel per device in a shard_map)."""
    if mesh is None or getattr(mesh, "empty", False):
        return False
    return int(mesh.size) > 1 and expert_axis_size(mesh) == 1
