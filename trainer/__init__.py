"""DiLoCoX training: the code a worker runs and attests to, and the coordinator's state machine.

    net/          the network edge: TLS, what one peer may cost, an emulated link, refusal reasons
    codec/        tensors as bytes: payloads (wire), the codecs and their registry, uplink, downlink
    model/        the GPT, the Hugging Face families, starting weights, parameters by name, stages
    data/         the byte corpus, tokenizers, prepared token directories, held-out evaluation
    rounds/       the round maths: aggregation's checks and means, the outer step, the schedule,
                  and the one transition from a closed round to the next checkpoint
    runstore/     a run's storage: run directory, update records, round inputs, checkpoints, gc
    runtime/      a worker's process runtime: devices, the inner loop, process groups, pipeline stages
    coordinator/  the coordinator: its state machine, intake, publication and gRPC service
    worker/       the worker: its role, loops, client and reporter
    config.py     the run's configuration (config_fields.py: how a field declares itself)
    progress.py   progress of long work

Each imports only those above it in tests/unit/test_layering.py's TRAINER_WINGS.
"""
