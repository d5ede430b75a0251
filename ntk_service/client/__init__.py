"""Python client for an ntk-service server (httpx, sync); imports without torch or fastapi.

    >>> from ntk_service.client import Client
    >>> client = Client("http://127.0.0.1:8000", api_key="...")  # doctest: +SKIP
    >>> theta = client.ntk("mlp", x1)  # doctest: +SKIP
    ... # (N, N, k, k) numpy array

Errors are the ``ntk_service.errors`` classes, mapped from the server's error bodies.
"""

from __future__ import annotations

from ntk_service.client._attribution import (
    AttributedExample,
    AttributionExample,
    AttributionFeaturesJob,
    AttributionJob,
    AttributionLossName,
    AttributionResult,
    FeatureKindName,
)
from ntk_service.client._base import (
    API_KEY_ENV,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_MAX_RETRY_WAIT_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    URL_ENV,
    TransportFormat,
)
from ntk_service.client._client import (
    Client,
    JobKernelDistance,
    JobKernelSpectrum,
    KernelComparison,
    KernelResult,
    KernelSpectrum,
    LinearizedPrediction,
)
from ntk_service.client._groups import GroupKernels
from ntk_service.client._kernel_family import MonteCarloKernel, NngpKernel
from ntk_service.client._module_spec import describe_module
from ntk_service.client._results import RemoteResult
from ntk_service.client._service import ServerInfo, ServerLimits
from ntk_service.client._solve import SolveJobResult
from ntk_service.client._types import (
    AlignmentVariantName,
    AnalysisModeName,
    DatasetArrayInfo,
    DatasetInfo,
    DatasetSlice,
    DtypeName,
    FamilyKernelName,
    FlowName,
    HealthStatus,
    ImplementationName,
    JobDeletion,
    JobInfo,
    JobModeName,
    JobSide,
    JobSpectrumMethodName,
    JobStatusName,
    KernelModeName,
    LossName,
    ModelInfo,
    OperatorModeName,
    ParameterShape,
    RidgeScaleName,
    SpectrumMethodName,
)

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_MAX_RETRY_WAIT_S",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "URL_ENV",
    "AlignmentVariantName",
    "AnalysisModeName",
    "AttributedExample",
    "AttributionExample",
    "AttributionFeaturesJob",
    "AttributionJob",
    "AttributionLossName",
    "AttributionResult",
    "Client",
    "DatasetArrayInfo",
    "DatasetInfo",
    "DatasetSlice",
    "DtypeName",
    "FamilyKernelName",
    "FeatureKindName",
    "FlowName",
    "GroupKernels",
    "HealthStatus",
    "ImplementationName",
    "JobDeletion",
    "JobInfo",
    "JobModeName",
    "JobKernelDistance",
    "JobKernelSpectrum",
    "JobSide",
    "JobStatusName",
    "KernelComparison",
    "KernelModeName",
    "KernelResult",
    "KernelSpectrum",
    "LinearizedPrediction",
    "LossName",
    "ModelInfo",
    "MonteCarloKernel",
    "NngpKernel",
    "OperatorModeName",
    "ParameterShape",
    "RemoteResult",
    "RidgeScaleName",
    "ServerInfo",
    "ServerLimits",
    "SolveJobResult",
    "JobSpectrumMethodName",
    "SpectrumMethodName",
    "TransportFormat",
    "describe_module",
]
