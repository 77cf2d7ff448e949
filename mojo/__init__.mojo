"""SRM token-mixer custom ops for MAX (srm_max.mojo).

    srm_mixer_step             (mixer_step.mojo)  decode step, state updated in place
    srm_mixer_step_functional  (mixer_step.mojo)  decode step, state in -> new state out
    srm_mixer_scan             (mixer_scan.mojo)  prefill scan: y and final state
"""
