"""The keys of a stock MindIE Service ``conf/config.json`` (MindIE 1.0 and 2.x) that are no Ferry setting.

Ferry's config file (:mod:`common.config_file`) has MindIE's layout, and the MindIE keys with a Ferry meaning
are Ferry settings of the same name (:mod:`common.settings`), so a MindIE file is read as it is, but for the
keys listed here:

- :data:`IGNORED`: accepted and ignored, because whatever a working MindIE file says there changes nothing in
  Ferry (the file format's version, the names of MindIE's only backend and only scheduling workflow);
- :data:`REFUSED`: what Ferry does not implement (NPU devices and memory, multi-node and prefill/decode
  disaggregated clusters, MindIE's scheduler policies, its per-plane TLS, encrypted key passwords and
  revocation lists, log files): :func:`common.config_file.flatten_config` names every one in the file at once,
  so that the user removes them in one pass, instead of Ferry silently running something else than asked.

Keys are grouped by section (the names of ``common.config_file.SECTION_PATHS``; ``""``: the top level;
``ModelConfig``: each item of ``ModelDeployConfig.ModelConfig``). README "Coming from MindIE" lists them.
"""

from __future__ import annotations

IGNORED: dict[str, frozenset[str]] = {
    "": frozenset({"Version"}),
    "BackendConfig": frozenset({"backendName"}),  # MindIE takes only "mindieservice_llm_engine"
    "ScheduleConfig": frozenset({"templateName"}),  # MindIE takes only "Standard_LLM"
}

REFUSED: dict[str, frozenset[str]] = {
    "": frozenset({"EnableDynamicAdjustTimeoutConfig"}),
    "LogConfig": frozenset({
        "logFileSize", "logFileNum", "logPath",  # Ferry logs to stderr
        "dynamicLogLevel", "dynamicLogLevelValidHours", "dynamicLogLevelValidTime",
    }),
    "ServerConfig": frozenset({
        # HTTPS beyond tlsCert / tlsPk: CA lists, encrypted key passwords (KMC), revocation lists, other planes'
        "tlsCaPath", "tlsCaFile", "tlsPkPwd", "tlsCrl", "tlsCrlPath", "tlsCrlFiles", "kmcKsfMaster", "kmcKsfStandby",
        "managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrl",
        "managementTlsCrlPath", "managementTlsCrlFiles", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk",
        "metricsTlsPkPwd", "metricsTlsCrlPath", "metricsTlsCrlFiles",
        # prefill/decode disaggregation and the links between instances
        "inferMode", "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath", "interCommTlsCaFiles",
        "interCommTlsCaFile", "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrl",
        "interCommTlsCrlPath", "interCommTlsCrlFiles", "distDPServerEnabled", "layerwiseDisaggregated",
        "layerwiseDisaggregatedRoleType", "layerwiseDisaggregatedMasterIpAddress",
        "layerwiseDisaggregatedSlaveIpAddress", "layerwiseDisaggregatedDataPort", "layerwiseDisaggregatedCrtlPort",
        "openAiSupport",  # MindIE's switch between two OpenAI dialects
        "HealthCheckConfig",  # its NPU usage threshold
    }),
    "BackendConfig": frozenset({
        "modelInstanceNumber", "npuDeviceIds", "tokenizerProcessNumber", "kvPoolConfig",
        # multi-node inference
        "multiNodesInferEnabled", "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath",
        "interNodeTlsCaFiles", "interNodeTlsCaFile", "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd",
        "interNodeTlsCrl", "interNodeTlsCrlPath", "interNodeTlsCrlFiles", "interNodeKmcKsfMaster",
        "interNodeKmcKsfStandby",
    }),
    "ScheduleConfig": frozenset({
        "templateType", "cacheBlockSize", "prefillTimeMsPerReq", "prefillPolicyType", "decodeTimeMsPerReq",
        "decodePolicyType", "maxPreemptCount", "supportSelectBatch", "maxQueueDelayMicroseconds",
        "maxFirstTokenWaitTime",
    }),
    "ModelConfig": frozenset({
        "modelInstanceType", "worldSize", "cpuMemSize", "npuMemSize", "backendType", "async_scheduler_wait_time",
        "kv_trans_timeout", "kv_link_timeout", "models",
    }),
}

# What Ferry has instead of a refused key, where removing it alone would change what the deployment does.
INSTEAD: dict[str, str] = {
    "tlsCaPath": "tlsCaCerts, one PEM bundle",
    "tlsCaFile": "tlsCaCerts, one PEM bundle",
    "tlsPkPwd": "an unencrypted tlsPk",
    "npuDeviceIds": "one worker per device, device npu:N",
}


def refused_key(dotted: str, key: str) -> str:
    """One refused key as the error names it: its dotted path, and what Ferry has instead where that matters."""
    instead = INSTEAD.get(key)
    return f"`{dotted}`" + (f" (Ferry: {instead})" if instead else "")
