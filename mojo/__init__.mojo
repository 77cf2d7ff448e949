"""srm-max's custom ops for MAX, the SRM's and the PHA's (srm_max.mojo).

    srm_mixer_step_functional  (mixer_step.mojo)   decode step, state in -> new state out (GPU decode)
    srm_mixer_scan             (mixer_scan.mojo)   prefill scan: y and final state
    srm_decode_step            (decode_step.mojo)  a whole decode step (every layer, logits), CPU
    srm_decode_steps           (decode_step.mojo)  S decode steps, tokens chosen inside, CPU
    srm_sample_rows            (sample_rows.mojo)  row_sampler's draw on given logits, CPU (tests)
    srm_write_state_rows       (state_rows.mojo)   rows of a state written in place (PHA decode)
    pha_decode_steps           (pha_decode_step.mojo) S PHA decode steps, tokens chosen inside, CPU
    srm_score_rows             (score_rows.mojo)   log-probabilities and top-n per row of logits, CPU
    pha_prefill_attention      (pha_prefill_attention.mojo) the PHA prefill's causal GQA attention, tiled, CPU
    srm_score_head             (score_head.mojo)   the output layer and srm_score_rows' reduction in one op, CPU
    pha_gss_scan               (pha_gss_scan.mojo) the PHA prefill's GSS scan: outputs and states, linear in T, CPU
    srm_linear                 (linear.mojo)       a dense layer x @ w^T + b, w packed per call, CPU
    srm_linear_packed          (linear_packed.mojo) a dense layer on a matrix packed at load, CPU
    pha_qk_rope                (pha_qk_rope.mojo)  the PHA prefill's queries and keys normalised and rotated, CPU
    pha_prefill_state          (pha_prefill_state.mojo) every layer's decode state from what a PHA prefill found, CPU

row_sampler.mojo registers no op: it is the per-row token choice of srm_decode_steps,
pha_decode_steps and srm_sample_rows; tiled_product.mojo registers none either: it is the
register-tiled product of srm_score_head, srm_linear, srm_linear_packed and pha_gss_scan.
The names are written once for Python in graphs/op_names.py; a test holds this list to
the registrations.
"""
