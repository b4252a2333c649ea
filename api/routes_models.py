"""``GET /v1/models`` and ``GET /v1/models/{model}``: the models this service accepts jobs for, as OpenAI's
``model`` objects, so that clients which list models first (the ``openai`` SDK's ``models.list()``, LangChain,
LiteLLM) find them.

A model is listed while the registry knows it (inferq/models_registry.py): a worker serves it now or did
recently, or ``inferq up`` announced it; exactly the models a submission is admitted for. Beside OpenAI's
fields each object says, as vLLM's server does, its ``max_model_len`` (null until a worker has published
it), and ``workers``: how many workers serve it at this moment (0 while one is still loading)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from api.auth import Principal, require_key
from api.openai_route import OpenAIRoute, error_responses, not_found
from inferq.models_registry import ModelCatalog, ModelEntry, name_problem

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


class ModelObject(BaseModel):
    id: str = Field(description="The model's name: the `model` field of a request.")
    object: Literal["model"] = Field("model", description="Always `model`.")
    created: int = Field(description="Unix seconds: when the model became known to this service.")
    owned_by: str = Field(description="Always `inferq`.")
    max_model_len: int | None = Field(description="The context length in tokens (null until a worker has "
                                      "published it).")
    workers: int = Field(description="Workers serving the model now (0 while one is still loading).")


class ModelList(BaseModel):
    object: Literal["list"] = Field("list", description="Always `list`.")
    data: list[ModelObject] = Field(description="Every model a job may name, by name.")


def _model_object(entry: ModelEntry, workers: int) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": int(entry.since or 0), "owned_by": "inferq",
            "max_model_len": entry.max_model_len, "workers": workers}


def _list(catalog: ModelCatalog) -> list[dict[str, Any]]:
    out = []
    for name, workers in catalog.serving().items():
        entry = catalog.get(name)
        if entry is not None:
            out.append(_model_object(entry, len(workers)))
    return out


@router.get("/models", summary="List models (OpenAI-compatible)", response_model=ModelList,
            responses=error_responses(), description="The models jobs may name. See docs/API.md.")
async def list_models(request: Request, principal: Principal = Depends(require_key)) -> dict[str, Any]:
    catalog = request.app.state.inferq.models
    return {"object": "list", "data": await run_in_threadpool(_list, catalog)}


@router.get("/models/{model}", summary="Retrieve a model (OpenAI-compatible)", response_model=ModelObject,
            responses=error_responses(404), description="One model, or 404 when no job may name it.")
async def get_model(model: str, request: Request, principal: Principal = Depends(require_key)) -> dict[str, Any]:
    catalog: ModelCatalog = request.app.state.inferq.models

    def one() -> dict[str, Any] | None:
        entry = catalog.get(model) if name_problem(model) is None else None
        return None if entry is None else _model_object(entry, len(catalog.serving().get(model, [])))

    found = await run_in_threadpool(one)
    if found is None:
        raise not_found("model", model, param="model")
    return found
