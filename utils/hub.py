"""Decide once, quickly, whether the Hugging Face hub is reachable, so offline runs never wait on network timeouts."""
import logging
import os
import socket
import threading
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
PROBE_TIMEOUT_S = 3.0
_decision: "bool | None" = None


def _env_says_offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_ENV_VARS)


def _probe(host: str, port: int, timeout: float) -> bool:
    """TCP connect in a daemon thread: DNS lookups ignore socket timeouts and can hang on a dead network."""
    result = {"ok": False}

    def connect():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result["ok"] = True
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return result["ok"]


def hub_is_offline() -> bool:
    """True when HF_HUB_OFFLINE & co. say so or the hub endpoint does not answer within a few seconds.

    When offline, the hub libraries are switched to offline mode too, so their own lookups read only the local
    cache (a dataset or tokenizer downloaded earlier still loads) instead of retrying the network.
    """
    global _decision
    if _decision is not None:
        return _decision
    if _env_says_offline():
        _decision = True
    elif any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        # Behind a proxy a direct probe proves nothing; let the libraries use the proxy.
        _decision = False
    else:
        endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        _decision = not _probe(endpoint.hostname or "huggingface.co", port, PROBE_TIMEOUT_S)
        if _decision:
            logger.info("Hugging Face hub not reachable (%s): working offline", endpoint.geturl())
    if _decision:
        _enable_offline_mode()
    return _decision


def _enable_offline_mode() -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[name] = "1"
    # huggingface_hub reads HF_HUB_OFFLINE once at import (transformers imported it already); its functions check
    # the module attribute at call time, so setting it makes cached lookups skip the network.
    try:
        from huggingface_hub import constants
        constants.HF_HUB_OFFLINE = True
    except (ImportError, AttributeError):
        pass
