"""The gateway's gRPC API (yinian.v1.Inference): the REST capabilities,
unary and server-streaming. Keys travel as "authorization" metadata."""

from __future__ import annotations

from opentelemetry import trace

from proto.yinian.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.common.convert import finish_to_proto, params_from_proto
from services.common.errors import InvalidRequest
from services.common.spans import request_attributes
from services.common.telemetry import context_from_grpc, tracer
from services.gateway.auth import Authenticator
from services.gateway.frontend import RunStats, TokenInfo
from services.gateway.gateway_core import GatewayCore

_tracer = tracer("yinian.gateway")


def _usage(stats: RunStats) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        cached_tokens=stats.cached_tokens,
    )


def _logprobs(infos: list[TokenInfo] | None) -> list[inference_pb2.TextLogprob]:
    return [
        inference_pb2.TextLogprob(
            token=i.token,
            logprob=i.logprob,
            top=[inference_pb2.TextLogprob.Top(token=t, logprob=lp) for t, lp in i.top],
        )
        for i in infos or ()
    ]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, core: GatewayCore, auth: Authenticator):
        self.core = core
        self.auth = auth

    def _tenant(self, context) -> str:
        metadata = dict(context.invocation_metadata() or ())
        return self.auth.tenant(metadata.get("authorization"))

    async def _prepare(self, request, context, chat: bool):
        tenant = self._tenant(context)
        self.core.check_model(request.model)
        if chat:
            prompt_ids = await self.core.chat_prompt(
                [{"role": m.role, "content": m.content} for m in request.messages]
            )
        else:
            which = request.WhichOneof("prompt")
            if which is None:
                raise InvalidRequest("a prompt (text or token_ids) is required")
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            prompt_ids = await self.core.tokenize(prompt)
        params = request.params
        max_tokens = params.max_tokens if params.HasField("max_tokens") else (None if chat else 16)

        def make(max_tokens_: int):
            msg = common_pb2.SamplingParams()
            msg.CopyFrom(params)
            msg.max_tokens = max_tokens_
            return params_from_proto(msg)

        prep = self.core.prepare(
            prompt_ids,
            make,
            max_tokens,
            tenant,
            request.priority,
            prefix="chatcmpl" if chat else "cmpl",
        )
        span = _tracer.start_as_current_span(
            "Inference.Chat" if chat else "Inference.Complete",
            kind=trace.SpanKind.SERVER,
            context=context_from_grpc(context),
            attributes=request_attributes(
                prep.request_id,
                tenant,
                self.core.model_name,
                len(prep.prompt_ids),
                prep.params.max_tokens,
            ),
        )
        return prep, span

    async def ListModels(self, request, context):
        self._tenant(context)
        return inference_pb2.ListModelsResponse(models=[self.core.model_name])

    async def _unary(self, request, context, chat: bool):
        prep, span = await self._prepare(request, context, chat)
        stats = RunStats()
        ticket = await self.core.admission.admit(prep.tenant, [prep])
        try:
            with span:
                results = await self.core.collect(prep, stats)
        finally:
            await ticket.release()
        return inference_pb2.CompletionResponse(
            id=prep.request_id,
            model=request.model,
            usage=_usage(stats),
            choices=[
                inference_pb2.Choice(
                    index=r.index,
                    text=r.text,
                    token_ids=r.token_ids,
                    finish_reason=finish_to_proto(r.finish_reason),
                    stop_reason="" if r.stop_reason is None else str(r.stop_reason),
                    logprobs=_logprobs(r.logprobs),
                )
                for r in results
            ],
        )

    async def _stream(self, request, context, chat: bool):
        prep, span = await self._prepare(request, context, chat)
        stats = RunStats()
        ticket = await self.core.admission.admit(prep.tenant, [prep])
        try:
            with span:
                async for ev in self.core.events(prep, stats):
                    yield inference_pb2.CompletionChunk(
                        id=prep.request_id,
                        model=request.model,
                        index=ev.index,
                        text=ev.text,
                        token_ids=ev.token_ids,
                        finish_reason=finish_to_proto(ev.finish_reason),
                        logprobs=_logprobs(ev.logprobs),
                    )
        finally:
            await ticket.release()
        yield inference_pb2.CompletionChunk(
            id=prep.request_id, model=request.model, usage=_usage(stats)
        )

    async def Complete(self, request, context):
        return await self._unary(request, context, chat=False)

    async def Chat(self, request, context):
        return await self._unary(request, context, chat=True)

    async def CompleteStream(self, request, context):
        async for chunk in self._stream(request, context, chat=False):
            yield chunk

    async def ChatStream(self, request, context):
        async for chunk in self._stream(request, context, chat=True):
            yield chunk
