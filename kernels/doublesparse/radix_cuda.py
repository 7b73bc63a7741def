"""DoubleSparse label scores + exact top-k as a CUDA radix select (``radix_cuda.cu``): the select at kernel speed
where one Triton program per head and chunk is latency-bound.

DoubleSparse (Yang et al., "Post-Training Sparse Attention with Double Sparsity", arXiv 2408.07092) scores every
cached token from a few label channels of its key and attends to the top-k.  Same signature and semantics as
:func:`.reference.select_topk` (exact top-k of the fp32 label scores); like the fused Triton select
(:func:`.triton_kernel.select_topk`) the indices come in token order and ties at the k-th score go to the lowest
tokens, so the two give identical indices on identical keys.

Why: the fused Triton select finds the k-th key by a 32-round bitwise search, one block-wide count per round, in one
program per head and chunk, and a merge program does it again over the chunks' candidates.  At batch 1 that is 64
block-wide reductions in series: 43 of the 67 us of a Llama-3-8B B1/32k ds8 read (session 28).  Triton has no
shared-memory atomics, so a radix select there pays ``tl.histogram`` (session 28's ``radix_triton``: slower).  In
CUDA a digit's histogram is one shared-memory atomic per key (warp-aggregated), as in GPU radix selects (AIR top-k,
Zhang et al. 2023; PyTorch's ``radixSelect``).  Two kernels:

1. keys (grid: token chunks x batch x kv heads x blocks of query heads, so every SM works at batch 1): the label
   scores of up to 8 query heads from one read of the kv head's labels, stored as order-preserving uint32 keys
   ``[B*Hq, T]`` (4 bytes per token and query head), and each head's histogram of the keys' top 10 bits (shared
   memory, then one global atomic per non-empty bin and CTA);
2. select (one 1024-thread CTA per query head): the digit of the k-th largest key from that histogram, then at most
   two passes over the head's keys (11-bit digits, shared-memory histograms of the keys still tied with the prefix)
   until the prefix holds exactly the keys still needed, and a last pass that writes the chosen token indices in
   token order (block-wide scans of the counts above / at the prefix).

3. or, where few query heads meet a long context (:func:`cluster_auto`: at batch 1 the two kernels leave most SMs
   idle - one select CTA per head), one thread-block cluster of C CTAs per query head (sm_90): each CTA scores its
   share of the tokens into its own shared memory, each digit's histogram is the sum of the C CTAs' (distributed
   shared memory), and each CTA writes its indices after the counts of the CTAs before it; one launch, no scratch.

Costs: the keys scratch is ``4 * B * Hq * T`` bytes (:data:`RADIX_CUDA_CONFIG` ``max_keys`` bounds it; larger calls
use the Triton select) and the select reads it 2-4 times (from L2 at small batches).  Nothing is compiled at
import: the first call builds one shared library with ``nvcc`` (cached as the KIVI kernel's, under
``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``) and binds its ``extern "C"`` launcher with :mod:`ctypes`.

:func:`emulate` is a PyTorch model of the same steps (digits, early stop, slots) that the CPU tests check against a
stable sort; the GPU tests run the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from pathlib import Path

import torch

from ..kivi.cuda_kernel import cache_root, compile_cached
from ..kivi.cuda_kernel import nvcc_path as _nvcc
from .reference import Labels, label_scores

SOURCE = Path(__file__).with_name("radix_cuda.cu")
NVCC_FLAGS = ("-O3", "-lineinfo", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
              "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80")
BITS0 = 10  # the keys kernel's digit (the top bits)
BITS = 11  # the select kernel's further digits
GMAX = 8  # query heads per keys CTA
RMAX = 256  # label channels
DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
U8 = 3
TPT = 8  # consecutive tokens per keys-kernel thread (keys rows are padded to a multiple)
SMEM_KEYS = 48 * 1024  # keys a select CTA may hold in shared memory (the library's limit)
SELECT_STATIC_SMEM = 10 * 1024  # the select kernel's static shared memory, rounded up
# chunk: tokens per keys CTA, a power of two from min_chunk to max_chunk aiming at ctas_per_sm CTAs per SM;
# max_keys: the largest keys scratch (B * Hq * T keys, 4 bytes each) a call may take (beyond: not supported);
# smem: the select kernel holds a head's keys in shared memory where they fit (else every pass reads them from L2);
# keys_threads (128 / 256) and rows_in_flight (1 / 4: label rows each thread loads before using them) of the keys
# CTAs, select_threads (256 / 512 / 1024) of the select CTAs.  smem / select_threads None: launch_shape's rule.
# Session 29 sweep (H200, docs/results.md): 256-thread keys CTAs loading one label row at a time were the fastest keys
# launch at 33 of 36 cells (e.g. SmolLM2 B64/32k ds8 380.6 us against 457.4 with 128 threads and 4 rows); the
# 1024-thread shared-memory select up to B16, the 512-thread select from L2 at B64 (Llama ds16 B64/32k 1134.8 against
# 1178.2 us; SmolLM2 ds8 B64/32k 373.3 against 380.6)
# max_keys 2**28 (1 GiB of keys): B64 / 128k takes the CUDA select (Llama ds16 B64/128k 0.96x -> 1.65x SDPA, SmolLM2
# ds8 0.57x -> 1.03x, session 29); the scratch is 4 bytes x G per token and kv head, 3% of an fp16 K/V layer at G = 4
# cluster: 0, or C = 1 / 2 / 4 / 8 CTAs per query head in one thread-block cluster (sm_90, ds_cluster_kernel: the keys
# in shared memory of the cluster's CTAs, one launch, no scratch; C = 1: one CTA scores and selects a head alone),
# where ceil(T / C) tokens fit SMEM_KEYS; None:
# cluster_auto's rule; cluster_threads per CTA (256 / 512 / 1024); cluster_rows_in_flight (1 / 4: label rows a
# thread loads before using them, as raw words: 4 fit a 1024-thread CTA's registers since session 30; with at most
# 512 threads it was slower, session 30)
# Session 30 (H200, docs/results.md): with the label rows held as raw words, 4 rows in flight became the default of
# both kernels - the cluster select at 1024 threads (Llama ds16 B1/128k 150.9 -> 127.2 us, SmolLM2 ds16 B1/32k 33.7 ->
# 29.1) and the keys CTAs (Llama ds8 B16/32k 451.3 -> 412.4 us; SmolLM2 ds8 B16/32k 126.0 -> 129.0, the one cell
# slower)
# emit_vectors (None / 1 / 2 / 4): 16-byte reads of 4 keys each that a thread takes per tile of the pass writing the
# chosen indices (both selects; one block scan per tile); None: :func:`emit_auto` - the fewest that cover a row's (or
# a cluster CTA's) keys in one tile.  Session 48 (H100, PART=ds-emit, two rounds, docs/results.md): 4 against 1 took
# 1 - 7 % less time where a CTA holds 16384 or more keys (per-head cluster selects at C = 2 and at 128k, the two-kernel
# selects at B16 / B64 over 32k) and 5 - 7 % more where it holds 4096 (shared selects at C = 8 over 32k: one tile
# either way, with a quarter of the threads doing the work).
RADIX_CUDA_CONFIG = dict(min_chunk=1024, max_chunk=8192, ctas_per_sm=2, max_keys=1 << 28, smem=None,
                         keys_threads=256, rows_in_flight=4, select_threads=None, cluster=None, cluster_threads=1024,
                         cluster_rows_in_flight=4, emit_vectors=None)
CLUSTER_STATIC_SMEM = 35 * 1024  # the cluster kernel's static shared memory, rounded up
_LOCK = threading.Lock()
_LIB: dict[str, ctypes.CDLL] = {}


# ----------------------------------------------------------------------------- capability, plan


def problem(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
            k: int = 1, cfg: dict | None = None) -> str | None:
    """Why the CUDA select cannot take this call (``None``: it can).  No compilation happens here."""
    from .triton_kernel import supports_scores

    cfg = dict(RADIX_CUDA_CONFIG, **(cfg or {}))
    unknown = sorted(set(cfg) - set(RADIX_CUDA_CONFIG))
    if unknown:
        raise ValueError(f"DoubleSparse CUDA select config: unknown entries {unknown}; known: {sorted(RADIX_CUDA_CONFIG)}")
    if cfg["keys_threads"] not in (128, 256) or cfg["rows_in_flight"] not in (1, 4) \
            or cfg["select_threads"] not in (None, 256, 512, 1024) or cfg["smem"] not in (None, True, False) \
            or cfg["cluster"] not in (None, 0, 1, 2, 4, 8) or cfg["cluster_threads"] not in (256, 512, 1024) \
            or cfg["cluster_rows_in_flight"] not in (1, 4) or cfg["emit_vectors"] not in (None, 1, 2, 4):
        raise ValueError(f"DoubleSparse CUDA select config: keys_threads {cfg['keys_threads']} (128 or 256), "
                         f"rows_in_flight {cfg['rows_in_flight']} (1 or 4), select_threads {cfg['select_threads']} "
                         f"(None, 256, 512 or 1024), smem {cfg['smem']} (None, true or false), cluster "
                         f"{cfg['cluster']} (None, 0, 1, 2, 4 or 8), cluster_threads {cfg['cluster_threads']} (256, 512 or "
                         f"1024), cluster_rows_in_flight {cfg['cluster_rows_in_flight']} (1 or 4), emit_vectors "
                         f"{cfg['emit_vectors']} (None, 1, 2 or 4)")
    if not query.is_cuda or not torch.cuda.is_available():
        return "not a CUDA tensor"
    if _capability(query.device.index or 0)[0] < 8:
        return "needs compute capability >= 8"
    if _nvcc() is None:
        return "no nvcc"
    if not supports_scores(query, labels, channels) or query.dtype not in DTYPES:
        return "arguments the label scores do not take (triton_kernel.supports_scores)"
    t = labels.num_tokens
    if t < 1 or (labels.data.stride(2) != 1 and t > 1):
        return "labels not token-contiguous (the plugin's channel-major label cache)"
    if channels.shape[1] > RMAX or channels.dtype != torch.int64:
        return f"{channels.shape[1]} label channels of {channels.dtype} (int64, at most {RMAX})"
    if labels.bits != 16 and (labels.scale.dtype != torch.float16 or labels.zero.dtype != torch.float16):
        return "label scale / zero not fp16"
    if valid is not None and (valid.dtype != torch.bool or valid.stride(-1) != 1):
        return "valid is not a bool tensor contiguous over tokens"
    if t >= 2 ** 31 or not 0 < k <= t:
        return f"{t} tokens, k {k}"
    if _cluster_for(query, t, cfg) is None and query.shape[0] * query.shape[1] * t > cfg["max_keys"]:
        return f"{query.shape[0] * query.shape[1] * t} keys exceed max_keys {cfg['max_keys']}"
    return None


def auto(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None, k: int,
         chunk_tokens: int, cfg: dict | None = None) -> bool:
    """Whether ``"auto"`` takes the CUDA select (:func:`.triton_kernel.select_method`): the cluster select where
    :func:`cluster_auto` gives a size (few query heads in the batch, a long context, sm_90); or the two kernels for a
    context the fused Triton select must split into chunks and merge (more than ``chunk_tokens``), several query
    heads per kv head (the keys kernel reads a kv head's labels once for all of them; the fused select once per query
    head) and at least a quarter as many query heads in the batch as SMs; and :func:`problem` finds nothing.  From the session 29 sweep
    (H200, 32k, docs/results.md): the CUDA select was faster at every such cell (Llama B4 ds8 127.1 against 152.3 us,
    SmolLM2 B4 58.8 against 71.4, Llama B64 ds16 1134.8 against 1388.4) and slower at batch 1 (Llama ds16 57.5 against
    50.4: 32 heads on 132 SMs, one select CTA per head), at 4k (one fused program per head, no merge) and, within
    4%, for group-shared selections at B4 / B64."""
    if not query.is_cuda:
        return False
    cfg = dict(RADIX_CUDA_CONFIG, **(cfg or {}))
    two = prefers_cuda(query.shape[0], query.shape[1], channels.shape[0], labels.num_tokens, chunk_tokens,
                       _sms(query.device.index or 0))
    cluster = cfg["cluster"] is None and _cluster_for(query, labels.num_tokens, cfg, chunk_tokens) is not None
    return (two or cluster) and problem(query, labels, channels, valid, k, cfg) is None


def prefers_cuda(batch: int, q_heads: int, kv_heads: int, tokens: int, chunk_tokens: int, sms: int) -> bool:
    """:func:`auto`'s rule on the shapes alone."""
    return tokens > chunk_tokens and q_heads > kv_heads and batch * q_heads * 4 >= sms


def plan(rows: int, tokens: int, sms: int, cfg: dict) -> int:
    """Tokens per keys CTA: the largest power of two in ``[min_chunk, max_chunk]`` that still gives ``rows`` (keys
    CTAs per chunk: batch x kv heads x query-head blocks) x chunks at least ``ctas_per_sm`` CTAs per SM; at least
    one step of every thread (``TPT x keys_threads`` tokens)."""
    least = max(int(cfg["min_chunk"]), TPT * int(cfg["keys_threads"]))
    chunk = max(int(cfg["max_chunk"]), least)
    while chunk > least and rows * -(-tokens // chunk) < cfg["ctas_per_sm"] * sms:
        chunk //= 2
    return chunk


def heads_per_cta(g: int) -> int:
    """Query heads one keys CTA scores (a power of two: the kernel's accumulators): the next power of two >= G, at
    most :data:`GMAX`."""
    n = 1
    while n < min(g, GMAX):
        n *= 2
    return n


# ----------------------------------------------------------------------------- build + launch


def cache_dir() -> Path:
    return cache_root() / "ds_cuda"


def nvcc_command(out: str, defines: tuple[str, ...] = ()) -> list[str]:
    return [_nvcc() or "nvcc", *NVCC_FLAGS, *(f"-D{d}" for d in defines), "-o", out, str(SOURCE)]


#: Preprocessor names a :func:`build` may define: ``DS_PHASES`` - the cluster select records per-CTA phase clocks
#: (``ds_radix_phases``; benchmarks/gpu_cluster_phases.py), never in the library the kernels use.
BUILD_DEFINES = ("DS_PHASES",)


def build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (or load from the cache) the library and bind its launcher; ``defines`` (of :data:`BUILD_DEFINES`)
    give a separate library (the phase clocks)."""
    unknown = [d for d in defines if d not in BUILD_DEFINES]
    if unknown:
        raise ValueError(f"build defines {unknown}: allowed {list(BUILD_DEFINES)}")
    defines = tuple(sorted(defines))
    key = " ".join(("lib", *defines))
    with _LOCK:
        if key in _LIB:
            return _LIB[key]
        src = SOURCE.read_bytes()
        extra = repr(defines).encode() if defines else b""  # (the default library keeps its cache name)
        tag = hashlib.sha256(src + repr(NVCC_FLAGS).encode() + extra).hexdigest()[:16]
        path = cache_dir() / f"libds_radix_{tag}.so"
        compile_cached(path, functools.partial(nvcc_command, defines=defines),
                       "building the DoubleSparse CUDA select failed; set KVCOMPRESS_DS_CONFIG="
                       "'{\"method\": \"fused\"}' to use the Triton select.")
        lib = ctypes.CDLL(str(path))
        lib.ds_radix_select_launch.restype = ctypes.c_int
        lib.ds_radix_select_launch.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_void_p]
        lib.ds_radix_error_string.restype = ctypes.c_char_p
        lib.ds_radix_error_string.argtypes = [ctypes.c_int]
        lib.ds_radix_smem_keys.restype = ctypes.c_longlong
        lib.ds_radix_cluster_launch.restype = ctypes.c_int
        lib.ds_radix_cluster_launch.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_int,
                                                ctypes.c_int, ctypes.c_void_p]
        lib.ds_radix_phases.restype = ctypes.c_int
        lib.ds_radix_phases.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_longlong]
        if (lib.ds_radix_bins0(), lib.ds_radix_gmax(), lib.ds_radix_rmax(), lib.ds_radix_smem_keys(),
                lib.ds_radix_pick_cap()) != (1 << BITS0, GMAX, RMAX, SMEM_KEYS, PICK_CAP):
            raise RuntimeError(f"{path} was built from another version of radix_cuda.cu")
        _LIB[key] = lib
        return lib


@functools.lru_cache(maxsize=8)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=8)
def _smem_optin(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


def keys_stride(tokens: int) -> int:
    """The keys scratch's row stride: ``tokens`` rounded up to :data:`TPT` (16-byte aligned rows)."""
    return -(-tokens // TPT) * TPT


#: :func:`cluster_auto` within one fused select chunk: a label cache of more tokens than this (the fused select then
#: holds 16384 keys per program) takes 4 CTAs per query head where 8 x rows fit one wave of SMs.  Session 45 (H100,
#: ``PART=ds-cluster-mid``, two rounds, docs/results.md): at 16k, 3 - 12 rows (SmolLM2 B1 per head and shared,
#: SmolLM2 B4 and Llama B1 group-shared) took 18 - 26 % less time with C = 4 than with the fused select (SmolLM2 B1
#: ds8 34.1 -> 26.8 us, 0.71x -> 0.91x SDPA) and 12 - 22 % with C = 8; at 32 and 36 rows (Llama B1, SmolLM2 B4 per
#: head) C = 4 was 6 - 19 % slower; at 8k every read was 14 - 182 % slower with either size.
CLUSTER_MID_TOKENS = 8192


def cluster_auto(rows: int, tokens: int, sms: int, chunk_tokens: int = 16384) -> int:
    """The cluster size ``cluster: None`` takes: 8 CTAs per query head where ``rows`` (batch x query heads) x 8 fit one
    wave of SMs; up to about 1.1 waves of 4 CTAs per head (37 rows on 132 SMs), 4 beyond 4 x ``chunk_tokens`` tokens
    and 2 below (where a CTA's half of the keys fits :data:`SMEM_KEYS`; :func:`cluster_plan` falls back otherwise);
    else 0 (the two kernels).  Where the fused select needs no merge (``tokens <= chunk_tokens``): 4 where the label
    cache holds more than :data:`CLUSTER_MID_TOKENS` tokens and 8 x ``rows`` fit one wave, else 0 (the fused select).

    From the H200 sweeps (docs/results.md), µs: session 29 - 3-12 rows at 32k, SmolLM2 B1 ds8 34.8 against the fused
    50.0, Llama ds16-shared B1 41.9 against 48.5, Llama ds16-shared B1/128k 71.6 against 127.5, every 4k cell slower
    (one fused program per head, no merge: Llama ds16 B1/4k 61.6 against 19.3); session 30 (4 label rows in flight) -
    32 rows at 32k with C = 2 (Llama ds8 B1 52.7 against the fused 65.4 and C = 4's 61.1; Llama ds8-shared B4 65.6
    against 82.9), 36 rows at 32k with C = 2 (SmolLM2 ds8 B4 48.1 against the two kernels' 54.4) and at 128k with
    C = 4 (142.1 against 170.7; C = 8 146.6); 8 rows at 32k keep C = 8 (Llama ds16-shared B1 34.4, C = 4 35.2, C = 2
    43.2)."""
    if tokens <= chunk_tokens:
        return 4 if tokens > CLUSTER_MID_TOKENS and rows * 8 <= sms else 0
    if rows * 8 <= sms:
        return 8
    if rows * 4 <= sms * 9 // 8:
        return 4 if tokens > 4 * chunk_tokens else 2
    return 0


def _cluster_for(query: torch.Tensor, tokens: int, cfg: dict, chunk_tokens: int = 16384) -> tuple[int, int] | None:
    """:func:`cluster_plan` of a call (``cfg["cluster"]`` None: :func:`cluster_auto`'s size)."""
    index = query.device.index or 0
    c = cfg["cluster"]
    if c is None:
        c = cluster_auto(query.shape[0] * query.shape[1], tokens, _sms(index), chunk_tokens)
    return cluster_plan(tokens, _capability(index), _smem_optin(index),
                        dict(cfg, cluster=c))


def emit_auto(keys: int, threads: int) -> int:
    """``emit_vectors: None``'s value for a CTA of ``threads`` threads emitting from ``keys`` keys: the fewest 16-byte
    reads per thread (1, 2 or 4) that take them in one tile, else 4 (session 48's timings: RADIX_CUDA_CONFIG's
    comment; 2, for 4097 - 8192 keys at 1024 threads, was not timed)."""
    for v in (1, 2):
        if keys <= threads * 4 * v:
            return v
    return 4


def emit_vectors_for(cfg: dict, keys: int, threads: int) -> int:
    """The emit_vectors of a CTA of ``threads`` threads over ``keys`` keys: ``cfg``'s, or :func:`emit_auto`'s."""
    return int(cfg["emit_vectors"]) if cfg["emit_vectors"] is not None else emit_auto(keys, threads)


def cluster_plan(tokens: int, capability: tuple[int, int], optin: int, cfg: dict) -> tuple[int, int] | None:
    """``(C, tokens per CTA)`` of the cluster select, or None (``cfg["cluster"]`` 0 / None, a GPU before sm_90, or a
    CTA's share of the keys beyond :data:`SMEM_KEYS` or the device's shared memory)."""
    c = int(cfg["cluster"] or 0)
    if not c or capability[0] < 9:
        return None
    n = keys_stride(-(-tokens // c))
    if n > SMEM_KEYS or n * 4 + CLUSTER_STATIC_SMEM > optin:
        return None
    return c, n


def launch_shape(rows: int, sms: int, cfg: dict) -> tuple[bool, int]:
    """``(smem wanted, select threads)``: ``cfg``'s entries, or where None: from ``rows`` (select CTAs: batch x query
    heads) of at least 4 per SM on, 512-thread selects reading the keys from L2 (several CTAs per SM), else 1024-thread
    selects holding them in shared memory (one CTA per SM, the fewest instructions per CTA)."""
    many = rows >= 4 * sms
    smem = (not many) if cfg["smem"] is None else bool(cfg["smem"])
    threads = (512 if many else 1024) if cfg["select_threads"] is None else int(cfg["select_threads"])
    return smem, threads


def smem_select(tokens: int, optin: int, cfg: dict, wanted: bool | None = None) -> bool:
    """Whether the select kernel holds the head's keys in shared memory: wanted (``wanted``, else ``cfg["smem"]`` with
    None as True) and they fit (the library's :data:`SMEM_KEYS` and the device's opt-in limit beside the kernel's
    static shared memory)."""
    ks = keys_stride(tokens)
    want = (cfg["smem"] is not False) if wanted is None else wanted
    return bool(want) and ks <= SMEM_KEYS and ks * 4 + SELECT_STATIC_SMEM <= optin


def vector_loads(labels: Labels) -> bool:
    """Whether the keys kernel may read :data:`TPT` tokens of a label row with one vector load: the data pointer and
    the batch / head / channel strides aligned to the vector (16 bytes for 16- and 32-bit labels, 8 for codes)."""
    data = labels.data
    esz = data.element_size()
    align = 8 if labels.bits != 16 else 16
    return data.data_ptr() % align == 0 and all((st * esz) % align == 0 for st in (data.stride(0), data.stride(1),
                                                                                   data.stride(3)))


def _input_args(query: torch.Tensor, labels: Labels, channels: torch.Tensor, va: torch.Tensor | None) -> list[int]:
    """The launchers' first 15 entries: query, channels (int64, contiguous: the caller keeps it alive), labels,
    scale / zero, valid (uint8 view) - pointers and strides."""
    lab = labels.data
    quant = labels.bits != 16
    return [query.data_ptr(), query.stride(0), query.stride(1), channels.data_ptr(), channels.stride(0),
            lab.data_ptr(), lab.stride(0), lab.stride(1), lab.stride(3),
            labels.scale.data_ptr() if quant else 0, labels.zero.data_ptr() if quant else 0,
            labels.scale.stride(0) if quant else 0, labels.scale.stride(1) if quant else 0,
            va.data_ptr() if va is not None else 0, va.stride(0) if va is not None else 0]


def select_topk_cuda(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                     k: int, *, config: dict | None = None, checked: bool = False, group: int = 1) -> torch.Tensor:
    """See :func:`.reference.select_topk`; the indices in token order (ties to the lowest tokens).  It raises on
    what :func:`problem` does not take (``checked``: the caller already asked :func:`problem` with this ``config``, as
    :func:`.triton_kernel.select_method` does).  With ``cluster`` set and a :func:`cluster_plan`, the cluster select
    runs instead of the two kernels (same indices).  ``group`` > 1: a row per ``group`` consecutive query heads,
    their query values added (fp32, in head order) as the kernels load them."""
    cfg = dict(RADIX_CUDA_CONFIG, **(config or {}))
    from .triton_kernel import group_rows

    full = query
    query = group_rows(full, labels, channels, group, checked)  # the rows' shape and first query rows from here on
    why = None if checked else problem(query, labels, channels, valid, k, cfg)
    if why is not None:
        raise ValueError(f"select_topk_cuda: {why}")
    b, hq, _ = query.shape
    dev = query.device
    cl = _cluster_for(query, labels.num_tokens, cfg)
    if cl is not None:
        threads = int(cfg["cluster_threads"])
        return _cluster_select(build(), query, labels, channels, valid, k, cl, threads,
                               int(cfg["cluster_rows_in_flight"]), group, full.stride(1),
                               emit_vectors_for(cfg, cl[1], threads))
    lib = build()
    hkv, r = channels.shape
    g = hq // hkv
    t = labels.num_tokens
    quant = labels.bits != 16
    gn = heads_per_cta(g)
    gblocks = -(-g // gn)
    sms = _sms(dev.index or 0)
    chunk = plan(b * hkv * gblocks, t, sms, cfg)
    want_smem, select_threads = launch_shape(b * hq, sms, cfg)
    channels = channels.to(device=dev).contiguous()
    lab = labels.data
    ks = keys_stride(t)
    keys = torch.empty(b * hq, ks, device=dev, dtype=torch.int32)
    hist = torch.zeros(b * hq, 1 << BITS0, device=dev, dtype=torch.int32)
    out = torch.empty(b, hq, k, device=dev, dtype=torch.int64)
    va = valid.view(torch.uint8) if valid is not None else None
    w = lab.shape[-1]
    args = [*_input_args(query, labels, channels, va), keys.data_ptr(), hist.data_ptr(),
            t, hq, hkv, g, w, 8 // labels.bits if quant else 1, labels.bits if quant else 16, chunk, gblocks, b,
            DTYPES[query.dtype], U8 if quant else DTYPES[lab.dtype], int(va is not None), k, out.data_ptr(), gn,
            int(vector_loads(labels)), ks, int(smem_select(t, _smem_optin(dev.index or 0), cfg, want_smem)),
            int(cfg["keys_threads"]), int(cfg["rows_in_flight"]), select_threads, group, full.stride(1),
            emit_vectors_for(cfg, t, select_threads)]
    arr = (ctypes.c_longlong * len(args))(*args)
    stream = torch.cuda.current_stream(dev).cuda_stream
    rc = lib.ds_radix_select_launch(arr, dev.index or 0, ctypes.c_void_p(stream))
    if rc:
        raise RuntimeError(f"DoubleSparse CUDA select launch failed: {lib.ds_radix_error_string(rc).decode()}")
    return out


def _cluster_select(lib, query, labels: Labels, channels, valid, k: int, cl: tuple[int, int],
                    threads: int, rows_in_flight: int = 1, group: int = 1, group_stride: int = 0,
                    emit_vectors: int = 1) -> torch.Tensor:
    """The cluster select (``ds_radix_cluster_launch``): C CTAs per query head (or per ``group`` query heads
    ``group_stride`` apart, summed), ``n`` tokens each."""
    c, n = cl
    b, hq, _ = query.shape
    hkv = channels.shape[0]
    dev = query.device
    quant = labels.bits != 16
    channels = channels.to(device=dev).contiguous()
    lab = labels.data
    out = torch.empty(b, hq, k, device=dev, dtype=torch.int64)
    va = valid.view(torch.uint8) if valid is not None else None
    args = [*_input_args(query, labels, channels, va), 0, 0, labels.num_tokens, hq, hkv, hq // hkv, lab.shape[-1],
            8 // labels.bits if quant else 1, labels.bits if quant else 16, n, 1, b, DTYPES[query.dtype], U8 if quant else DTYPES[lab.dtype],
            int(va is not None), k, out.data_ptr(), 1, int(vector_loads(labels)), 0, 0, 0, rows_in_flight, 0, group,
            group_stride, emit_vectors]
    arr = (ctypes.c_longlong * len(args))(*args)
    stream = torch.cuda.current_stream(dev).cuda_stream
    rc = lib.ds_radix_cluster_launch(arr, c, threads, dev.index or 0, ctypes.c_void_p(stream))
    if rc:
        raise RuntimeError(f"DoubleSparse CUDA cluster select launch failed: {lib.ds_radix_error_string(rc).decode()}")
    return out


# ----------------------------------------------------------------------------- pure-PyTorch model of the kernels


def orderable(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the kernels' order-preserving uint32 key, as int64 (``-inf`` lowest)."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2 ** 31, (~bits) & 0xFFFFFFFF, bits | 2 ** 31)


def find_digit(hist: torch.Tensor, need: int) -> tuple[int, int]:
    """The kernels' ``find_digit``: ``(digit, keys in higher digits)`` of the digit holding the ``need``-th largest
    key of the histogram ``hist`` (counts per digit value)."""
    desc = hist.flip(0)
    before = torch.cumsum(desc, 0) - desc  # keys in higher digits, per digit from the top
    j = int(((before < need) & (before + desc >= need)).nonzero()[0])
    return hist.numel() - 1 - j, int(before[j])


def cluster_find_grouped(hists: list[torch.Tensor], need: int, rank: int) -> tuple[int, int, int, int, int]:
    """The cluster select's ``cluster_find``, step by step as its one warp takes them (32 lanes, one or two 32-bin
    groups a lane in descending order, then the found group's 32 bins, one a lane, descending), on the C CTAs'
    histograms ``hists`` from CTA ``rank``'s side: ``(digit, keys in higher digits, of them in the CTAs before rank,
    keys at the digit, of them in the CTAs before rank)`` - what :func:`find_digit` on the summed histogram gives,
    with the counts of the CTAs before ``rank`` (tests/test_doublesparse_cuda.py checks the two agree)."""
    nb = hists[0].numel()
    groups = nb // 32
    per = groups // 32
    gsums = [h.view(groups, 32).sum(1).tolist() for h in hists]  # each CTA's group sums (before the barrier)
    lane_tot = []
    for lane in range(32):  # a lane's groups: the cluster's and the earlier CTAs' keys in them
        gs = [groups - 1 - (lane * per + u) for u in range(per)]
        lane_tot.append([(g, sum(s[g] for s in gsums), sum(s[g] for s in gsums[:rank])) for g in gs])
    before = [0, 0]
    found = None
    for lane in range(32):  # the warp's exclusive scan, then each lane's groups in order
        for g, tg, tb in lane_tot[lane]:
            if found is None and before[0] < need <= before[0] + tg:
                found = (g, before[0], before[1])
            before = [before[0] + tg, before[1] + tb]
    g, ax, ay = found
    bx, by = ax, ay
    for lane in range(32):
        b = g * 32 + 31 - lane
        cnt = sum(int(h[b]) for h in hists)
        cntb = sum(int(h[b]) for h in hists[:rank])
        if bx < need <= bx + cnt:
            return b, bx, by, cnt, cntb
        bx, by = bx + cnt, by + cntb
    raise AssertionError("no digit holds the need-th key")


def select_keys(keys: torch.Tensor, k: int, trace: list | None = None) -> list[int]:
    """``ds_select_kernel`` on one head's keys (int64 ``[T]`` holding uint32 values): its token indices in output slot
    order, from the same digit steps, early stop and slots (:func:`select_keys_cluster` with one CTA).  ``trace``:
    gets ``(bits fixed, keys still needed, keys at the prefix)`` after each digit."""
    return select_keys_cluster(keys, k, 1, trace, pick_cap=0)


#: The cluster select's exact pick (``radix_cuda.cu``, ``pick_exact``): once at most this many keys of the cluster
#: are left at the prefix, one round picks among them by (key, token) instead of a digit's histogram round.
PICK_CAP = 128


def select_keys_cluster(keys: torch.Tensor, k: int, c: int, trace: list | None = None,
                        pick_cap: int = PICK_CAP) -> list[int]:
    """``ds_cluster_kernel`` on one head's keys split over ``c`` CTAs of ``n = keys_stride(ceil(T / c))`` tokens:
    each digit's histogram summed over the CTAs' histograms, each CTA's indices placed after the (above, tie) counts
    of the CTAs before it; once at most ``pick_cap`` keys are left at the prefix, the exact pick instead of more
    digits (``pick_cap = 0`` and ``c = 1``: ``ds_select_kernel``).  ``trace`` as for :func:`select_keys`, the exact
    pick's entry ``(32, ties still needed, ties at kstar, "pick")``."""
    t = keys.numel()
    n = keys_stride(-(-t // c))
    parts = [keys[r * n:min((r + 1) * n, t)] for r in range(c)]
    hists = [torch.bincount(part >> (32 - BITS0), minlength=1 << BITS0) for part in parts]  # per CTA
    comb = sum(hists)
    digit, before = find_digit(comb, k)
    prefix, need, shift, in_bin = digit, k - before, 32 - BITS0, int(comb[digit])
    # CTA r's counts of the CTAs before it, from the digits' histograms (the kernel's combb): keys in higher digit
    # values at every digit, ties in the last digit's bin
    above_before = [sum(int(h[digit + 1:].sum()) for h in hists[:r]) for r in range(c)]
    if trace is not None:
        trace.append((32 - shift, need, in_bin))
    tie_before = None
    while in_bin != need and shift > 0:
        if in_bin <= pick_cap:  # pick_exact: every CTA's keys at the prefix, in rank (token) order
            cand = [(int(key), r * n + i, r) for r, part in enumerate(parts)
                    for i, key in enumerate(part.tolist()) if key >> shift == prefix]
            kstar = sorted(cand, key=lambda x: (-x[0], x[1]))[need - 1][0]
            above_before = [a + sum(x[0] > kstar for x in cand if x[2] < r) for r, a in enumerate(above_before)]
            tie_before = [sum(x[0] == kstar for x in cand if x[2] < r) for r in range(c)]
            prefix, need, shift = kstar, need - sum(x[0] > kstar for x in cand), 0
            if trace is not None:
                trace.append((32, need, sum(x[0] == kstar for x in cand), "pick"))
            break
        nb = min(BITS, shift)
        low = shift - nb
        hists = [torch.bincount((part[(part >> shift) == prefix] >> low) & ((1 << nb) - 1), minlength=1 << nb)
                 for part in parts]
        comb = sum(hists)
        digit, before = find_digit(comb, need)
        prefix, need, shift, in_bin = (prefix << nb) | digit, need - before, low, int(comb[digit])
        above_before = [a + sum(int(h[digit + 1:].sum()) for h in hists[:r]) for r, a in enumerate(above_before)]
        if trace is not None:
            trace.append((32 - shift, need, in_bin))
    if tie_before is None:
        tie_before = [sum(int(h[digit]) for h in hists[:r]) for r in range(c)]
    out = torch.full((k,), -1, dtype=torch.int64)
    for r, part in enumerate(parts):
        hi = part >> shift
        above, tie = hi > prefix, hi == prefix
        ab = above_before[r] + torch.cumsum(above.long(), 0) - above.long()  # keys above before each token
        tb = tie_before[r] + torch.cumsum(tie.long(), 0) - tie.long()  # ties before each token
        chosen = above | (tie & (tb < need))
        slot = ab + torch.minimum(tb, torch.tensor(need))
        out[slot[chosen]] = chosen.nonzero().flatten() + r * n
    return out.tolist()


def emulate(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
            k: int) -> torch.Tensor:
    """A PyTorch model of :func:`select_topk_cuda` (same signature): keys from the reference's fp32 label scores,
    then :func:`select_keys` per query head."""
    scores = label_scores(query, labels, channels, valid)  # [B, Hq, T]
    keys = orderable(scores)
    b, hq, t = keys.shape
    rows = [select_keys(keys[i, j], k) for i in range(b) for j in range(hq)]
    return torch.tensor(rows, dtype=torch.int64).view(b, hq, k)
