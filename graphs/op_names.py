"""The Mojo custom ops' names, as ``mojo/*.mojo`` registers them (``@register("...")``):
written once here for every graph that calls an op and for the runtime's kernel library
(``srm_max.runtime.kernels``); tests/project/test_one_owner.py holds each equal to a
registration in ``mojo/``."""

OP_STEP_FUNCTIONAL = "srm_mixer_step_functional"  # one mixer step, state in -> new state out
OP_SCAN = "srm_mixer_scan"  # the mixer over a whole prompt (prefill)
OP_DECODE_STEP = "srm_decode_step"  # every layer of an SRM decode step and the logits
OP_DECODE_STEPS = "srm_decode_steps"  # S SRM decode steps, each token chosen in the op
OP_SAMPLE_ROWS = "srm_sample_rows"  # the decode op's draw on given logits
OP_WRITE_STATE_ROWS = "srm_write_state_rows"  # the PHA decode's in-place state write
OP_PHA_DECODE_STEPS = "pha_decode_steps"  # S PHA decode steps in one op
OP_SCORE_ROWS = "srm_score_rows"  # log-probabilities and top-K per row of given logits
OP_PHA_PREFILL_ATTENTION = "pha_prefill_attention"  # the PHA prefill's causal GQA attention, tiled
OP_SCORE_HEAD = "srm_score_head"  # the output layer and srm_score_rows' reduction in one op (no [R, V] logits)
OP_PHA_GSS_SCAN = "pha_gss_scan"  # the PHA prefill's GSS scan: outputs and states, linear in T
OP_LINEAR = "srm_linear"  # a dense layer x @ w^T + b through the register-tiled product, CPU
OP_LINEAR_PACKED = "srm_linear_packed"  # srm_linear on a matrix packed at load (the decode ops' panels), CPU
OP_PHA_QK_ROPE = "pha_qk_rope"  # the PHA prefill's queries and keys normalised and rotated, CPU
OP_PHA_PREFILL_STATE = "pha_prefill_state"  # every layer's decode state from what a PHA prefill found, CPU

ALL_OPS = (OP_STEP_FUNCTIONAL, OP_SCAN, OP_DECODE_STEP, OP_DECODE_STEPS, OP_SAMPLE_ROWS,
           OP_WRITE_STATE_ROWS, OP_PHA_DECODE_STEPS, OP_SCORE_ROWS,
           OP_PHA_PREFILL_ATTENTION, OP_SCORE_HEAD, OP_PHA_GSS_SCAN, OP_LINEAR, OP_LINEAR_PACKED, OP_PHA_QK_ROPE,
           OP_PHA_PREFILL_STATE)
