"""``/api/v1/devices/{device_id}/cameras/{camera}/model``: a model version assigned to one camera
directly (the device's own layer, under any deployment's), published as its new desired state."""

from __future__ import annotations

from fastapi import APIRouter

from controller.api.deps import CameraPath, DeviceIdPath, RuntimeDep
from controller.api.schemas import AssignModel
from fleet_protocol.messages import DesiredState

router = APIRouter(prefix="/api/v1/devices", tags=["assignments"])


@router.put(
    "/{device_id}/cameras/{camera}/model",
    response_model=DesiredState,
    summary="Run a model version on a camera: publishes the device's new desired state (retained)",
    responses={404: {"description": "unknown device or model"}},
)
def assign_model(
    device_id: DeviceIdPath, camera: CameraPath, body: AssignModel, rt: RuntimeDep
) -> DesiredState:
    return rt.twin.assign(
        device_id=device_id,
        camera=camera,
        model=body.model,
        version=body.version,
        threshold=body.threshold,
        max_fps=body.max_fps,
        labels=body.labels,
        variant=body.variant,
        label_thresholds=body.label_thresholds,
        min_box_area=body.min_box_area,
        zones=[z.model_dump(mode="json", exclude_none=True) for z in body.zones] if body.zones else None,
        lines=[ln.model_dump(mode="json", exclude_none=True) for ln in body.lines] if body.lines else None,
        motion=body.motion.model_dump(mode="json") if body.motion is not None else None,
    )


@router.delete(
    "/{device_id}/cameras/{camera}/model",
    response_model=DesiredState,
    summary="Stop running a model on a camera: publishes the new desired state (retained)",
    responses={404: {"description": "unknown device, or no model on that camera"}},
)
def remove_model(device_id: DeviceIdPath, camera: CameraPath, rt: RuntimeDep) -> DesiredState:
    return rt.twin.remove(device_id=device_id, camera=camera)
