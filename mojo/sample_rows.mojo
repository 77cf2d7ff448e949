"""The per-row draw of the decode ops (row_sampler.mojo) on given logits, CPU: what
tests/test_sampled_decode.py compares with graphs/sampler.py's ``sample`` on rows it
makes (ties, flat and peaked rows, any top-k and top-p).

    srm_sample_rows(logits [B, V] f32, temperature [B] f32, top_k [B] int64, top_p [B] f32,
                    seed [B] uint64, counter [B] int64, mode [1] int64: graphs/sampler.py's MODE_*)
        -> tokens [B] int64
"""
from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

from .row_sampler import RowScratch, choose_token, first_argmax

comptime F32 = DType.float32
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime MODE_GREEDY = 0  # graphs/sampler.py
comptime MODE_FILTERED = 2


@register("srm_sample_rows")
struct SrmSampleRows:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        tokens: OutputTensor[dtype=DType.int64, rank=1, ...],
        logits: InputTensor[dtype=F32, rank=2, ...],
        temperature: InputTensor[dtype=F32, rank=1, ...],
        top_k: InputTensor[dtype=DType.int64, rank=1, ...],
        top_p: InputTensor[dtype=F32, rank=1, ...],
        seed: InputTensor[dtype=DType.uint64, rank=1, ...],
        counter: InputTensor[dtype=DType.int64, rank=1, ...],
        mode: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_sample_rows: CPU only")
        var B = logits.dim_size(0)
        var V = logits.dim_size(1)
        var m = Int(mode[0])
        var row = List[Float32](length=V, fill=0)  # choose_token overwrites its row
        var rp = F32P(unsafe_from_address=Int(row.unsafe_ptr()))
        var lp = F32P(unsafe_from_address=Int(logits.unsafe_ptr()))  # [B, V] row-major
        var scratch = RowScratch(V)
        for b in range(B):
            for i in range(V):
                rp[unsafe_offset=i] = lp[unsafe_offset=b * V + i]
            if m == MODE_GREEDY:
                tokens[b] = Int64(first_argmax(rp, V))
            else:
                tokens[b] = Int64(choose_token(
                    rp, V, temperature[b], Int(top_k[b]), top_p[b], seed[b], counter[b], m == MODE_FILTERED,
                    scratch,
                ))
        _ = row^  # rp points into it
