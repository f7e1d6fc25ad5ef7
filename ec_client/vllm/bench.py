"""`python -m ec_client.vllm.bench`, the command users already run: the connector's bench lives in
ec_bench.vllm (`python -m ec_bench.vllm`), beside the daemon's."""

from ec_bench.vllm import main

if __name__ == "__main__":
    main()
