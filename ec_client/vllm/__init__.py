"""ecd as vLLM's encoder cache: an out-of-tree EC connector (vLLM 0.33, V2 model runner).

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECDaemonConnector",
        "ec_connector_module_path": "ec_client.vllm", "ec_role": "ec_both",
        "ec_connector_extra_config": {"ecd_address": "unix:///run/ecd/ecd.sock",
                                      "ec_cpu_bytes": 8589934592}}'

Importing this package imports vLLM; importing `ec_client` alone does not.
"""

from ec_client.vllm.connector import ECDaemonConnector

__all__ = ["ECDaemonConnector"]
