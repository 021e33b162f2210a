"""The `Worker` gRPC service every engine worker answers: who it is and how
loaded it is."""

from __future__ import annotations

from proto.yinian.v1 import common_pb2, scheduler_pb2, worker_pb2_grpc
from services.worker.reports import WorkerReports


def load_report(load: dict) -> common_pb2.LoadReport:
    fields = common_pb2.LoadReport.DESCRIPTOR.fields_by_name
    return common_pb2.LoadReport(**{k: v for k, v in load.items() if k in fields})


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, info: scheduler_pb2.WorkerInfo, reports: WorkerReports):
        self.info = info
        self.reports = reports

    async def GetInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        return load_report(self.reports.load())
