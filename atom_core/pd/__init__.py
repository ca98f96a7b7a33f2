"""Prefill/decode disaggregation (PD): a prefill worker computes a prompt's KV and ships it to a
decode worker, which keeps decoding from there.

    payload      the KV payload and the checks a decode worker runs on it; the PD key
    transport    message transports between workers (in-process, torch.distributed/gloo)
    secure_link  the authenticated, encrypted link over a transport (handshake, AEAD, replay)
    workers      the prefill and the decode worker
    links        one worker's links to many peers, as the one transport its worker expects
    router       which decode and which prefill worker serve a request
    cluster      N prefill workers, M decode workers and the router, in one process
    cluster_run  the same across processes, one per worker (torchrun / gloo)
"""
