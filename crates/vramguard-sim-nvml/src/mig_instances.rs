//! MIG's GPU-instance queries: the profiles a MIG-capable GPU offers (what `nvidia-smi mig
//! -lgip` lists), their placements, and on a GPU in MIG mode its GPU instances (from the
//! state's MIG devices) with their handles and info. Creating or destroying instances is
//! `nvidia-smi mig`'s job and is not simulated.
//!
//! NVML's rules, followed here: profile info (v1) and placements answer on any MIG-capable
//! GPU; the versioned profile info, the instances, an instance by id and the remaining
//! capacity answer `NOT_SUPPORTED` unless MIG mode is on; a V100 supports none of it.

use crate::device_info::put;
use crate::device_queries::struct_version;
use crate::{
    ARGUMENT_VERSION_MISMATCH, INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED,
    ObservedGpu, SUCCESS, decode_handle, handle_of, with_gpu, with_sim,
};
use nvml_wrapper_sys::bindings::*;
use std::ffi::c_uint;

/// One GPU-instance profile of a model.
struct Profile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: the index callers ask with.
    index: c_uint,
    /// The profile id `nvidia-smi mig -lgip` shows.
    id: c_uint,
    /// Compute slices (the `Ng` of the name).
    slices: c_uint,
    /// Memory slices of the GPU's eight.
    memory_slices: c_uint,
    /// How many instances of it fit on one GPU.
    instances: c_uint,
    /// The media-extension variant (`+me`): all decoders, JPEG and OFA on one slice.
    media: bool,
}

/// H100/H200 (and A100 80GB) profiles, in `nvidia-smi mig -lgip` order.
const PROFILES: [Profile; 7] = [
    Profile {
        index: 0,
        id: 19,
        slices: 1,
        memory_slices: 1,
        instances: 7,
        media: false,
    },
    Profile {
        index: 7,
        id: 20,
        slices: 1,
        memory_slices: 1,
        instances: 1,
        media: true,
    },
    Profile {
        index: 9,
        id: 15,
        slices: 1,
        memory_slices: 2,
        instances: 4,
        media: false,
    },
    Profile {
        index: 1,
        id: 14,
        slices: 2,
        memory_slices: 2,
        instances: 3,
        media: false,
    },
    Profile {
        index: 2,
        id: 9,
        slices: 3,
        memory_slices: 4,
        instances: 2,
        media: false,
    },
    Profile {
        index: 3,
        id: 5,
        slices: 4,
        memory_slices: 4,
        instances: 1,
        media: false,
    },
    Profile {
        index: 4,
        id: 0,
        slices: 7,
        memory_slices: 8,
        instances: 1,
        media: false,
    },
];

/// Whether the model supports MIG at all (Ampere and Hopper data-centre GPUs).
fn mig_capable(gpu: &ObservedGpu) -> bool {
    !gpu.name.contains("V100")
}

/// SMs in `slices` compute slices: an H100/H200 has 132 (16 per slice, 26 for the
/// double-memory 1g, 60/64 for 3g/4g), an A100 98.
fn multiprocessors(gpu: &ObservedGpu, p: &Profile) -> c_uint {
    // (A100, H100/H200) SMs by compute slices; the double-memory 1g has more on Hopper.
    let (a100, hopper) = match (p.slices, p.memory_slices) {
        (7, _) => (98, 132),
        (4, _) => (56, 64),
        (3, _) => (42, 60),
        (2, _) => (28, 32),
        (1, 2) => (14, 26),
        _ => (14, 16),
    };
    if gpu.name.contains("A100") {
        a100
    } else {
        hopper
    }
}

/// The GPU's whole memory, MiB (what the 7g profile gets).
fn gpu_memory_mib(gpu: &ObservedGpu) -> u64 {
    (gpu.total + gpu.reserved) >> 20
}

/// The profile's memory, MiB: its share of the eight memory slices, in 256 MiB units.
fn memory_mib(gpu: &ObservedGpu, p: &Profile) -> u64 {
    gpu_memory_mib(gpu) * u64::from(p.memory_slices) / 8 / 256 * 256
}

/// The profile's name as NVIDIA writes it, e.g. `3g.71gb` on an H200, `1g.10gb+me` on an
/// H100: the GB figure is the model's per-slice label, not a computation.
fn profile_name(gpu: &ObservedGpu, p: &Profile) -> String {
    let per_slices: [(c_uint, u64); 4] = if gpu.name.contains("H200") {
        [(1, 18), (2, 35), (4, 71), (8, 141)]
    } else {
        [(1, 10), (2, 20), (4, 40), (8, 80)]
    };
    let gb = per_slices
        .iter()
        .find(|(s, _)| *s == p.memory_slices)
        .map_or(0, |(_, gb)| *gb);
    format!("{}g.{gb}gb{}", p.slices, if p.media { "+me" } else { "" })
}

fn by_index(index: c_uint) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.index == index)
}

fn by_id(id: c_uint) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.id == id)
}

/// The v1 record of a profile.
fn profile_info(gpu: &ObservedGpu, p: &Profile) -> nvmlGpuInstanceProfileInfo_t {
    let media = |n: c_uint| if p.media { 7 } else { n };
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: multiprocessors(gpu, p),
        copyEngineCount: if p.slices == 7 { 8 } else { p.slices },
        decoderCount: media(p.slices),
        encoderCount: 0,
        jpegCount: media(p.slices),
        ofaCount: u32::from(p.media || p.slices == 7),
        memorySizeMB: memory_mib(gpu, p),
    }
}

/// Profile info by profile index (`NVML_GPU_INSTANCE_PROFILE_*`).
///
/// # Safety
/// `info` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetGpuInstanceProfileInfo", device, |_, gpu| {
        if !mig_capable(gpu) {
            return NOT_SUPPORTED;
        }
        match by_index(profile) {
            Some(p) => unsafe { put(info, profile_info(gpu, p)) },
            None if profile < 12 => NOT_SUPPORTED,
            None => INVALID_ARGUMENT,
        }
    })
}

/// Fills the versioned record (v2 or v3; v3 adds capabilities, none here).
unsafe fn fill_profile_v(
    gpu: &ObservedGpu,
    p: Option<&Profile>,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> c_uint {
    if info.is_null() {
        return INVALID_ARGUMENT;
    }
    if !mig_capable(gpu) || !gpu.mig {
        return NOT_SUPPORTED;
    }
    let version = unsafe { (*info).version };
    let v2 = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
    let v3 = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
    if version != v2 && version != v3 {
        return ARGUMENT_VERSION_MISMATCH;
    }
    let Some(p) = p else {
        return NOT_SUPPORTED;
    };
    let v1 = profile_info(gpu, p);
    let out = unsafe { &mut *info };
    out.id = v1.id;
    out.isP2pSupported = v1.isP2pSupported;
    out.sliceCount = v1.sliceCount;
    out.instanceCount = v1.instanceCount;
    out.multiprocessorCount = v1.multiprocessorCount;
    out.copyEngineCount = v1.copyEngineCount;
    out.decoderCount = v1.decoderCount;
    out.encoderCount = v1.encoderCount;
    out.jpegCount = v1.jpegCount;
    out.ofaCount = v1.ofaCount;
    out.memorySizeMB = v1.memorySizeMB;
    crate::copy_into(&mut out.name, &profile_name(gpu, p));
    if version == v3 {
        unsafe { (*info.cast::<nvmlGpuInstanceProfileInfo_v3_t>()).capabilities = 0 };
    }
    SUCCESS
}

/// Versioned profile info by profile index, with the profile's name.
///
/// # Safety
/// `info` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        device,
        |_, gpu| unsafe { fill_profile_v(gpu, by_index(profile), info) },
    )
}

/// Versioned profile info by profile id (19, 20, 15, 14, 9, 5, 0).
///
/// # Safety
/// `info` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
        device,
        |_, gpu| unsafe { fill_profile_v(gpu, by_id(profile_id), info) },
    )
}

/// Where instances of a profile can start, in memory slices: every `size`-aligned start
/// that fits (7 for 1g, 4 for 1g.2-slice, 3 for 2g, 2 for 3g, 1 for 4g and 7g).
fn placements(p: &Profile) -> Vec<nvmlGpuInstancePlacement_t> {
    let size = p.memory_slices;
    (0..8)
        .step_by(size as usize)
        .filter(|start| start + size <= 8)
        .take(p.instances as usize)
        .map(|start| nvmlGpuInstancePlacement_t { start, size })
        .collect()
}

/// Possible placements of a profile, whether or not MIG is on (count-then-fill).
///
/// # Safety
/// `count` must be writable; `out` holds `*count` entries or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    out: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        device,
        |_, gpu| {
            if count.is_null() {
                return INVALID_ARGUMENT;
            }
            if !mig_capable(gpu) {
                return NOT_SUPPORTED;
            }
            let Some(p) = by_id(profile_id) else {
                return NOT_SUPPORTED;
            };
            let all = placements(p);
            let capacity = unsafe { *count } as usize;
            unsafe { *count = all.len() as c_uint };
            if out.is_null() {
                return SUCCESS;
            }
            if capacity < all.len() {
                return INSUFFICIENT_SIZE;
            }
            for (i, v) in all.into_iter().enumerate() {
                unsafe { *out.add(i) = v };
            }
            SUCCESS
        },
    )
}

/// One GPU instance of a GPU in MIG mode: its id, profile and placement.
struct Instance {
    id: c_uint,
    profile: &'static Profile,
    start: c_uint,
}

/// The GPU instances behind the state's MIG devices (several compute instances may share
/// one), in id order, placed one after the other.
fn instances(gpu: &ObservedGpu) -> Vec<Instance> {
    let mut seen: Vec<(c_uint, &str)> = gpu
        .mig_devices
        .iter()
        .map(|d| (d.gpu_instance, d.profile.as_str()))
        .collect();
    seen.sort_unstable();
    seen.dedup_by_key(|(id, _)| *id);
    let mut start: c_uint = 0;
    seen.into_iter()
        .filter_map(|(id, name)| {
            let profile = PROFILES.iter().find(|p| profile_name(gpu, p) == name)?;
            let aligned = start.div_ceil(profile.memory_slices) * profile.memory_slices;
            start = aligned + profile.memory_slices;
            Some(Instance {
                id,
                profile,
                start: aligned,
            })
        })
        .collect()
}

/// A GPU instance's handle: the GPU's index and the instance id, above the range of device
/// handles.
fn instance_handle(gpu_index: u32, id: c_uint) -> nvmlGpuInstance_t {
    (((id as usize + 1) << 24) | (gpu_index as usize + 1)) as nvmlGpuInstance_t
}

/// The GPU instances of a profile on a GPU in MIG mode (count-then-fill).
///
/// # Safety
/// `count` must be writable; `out` holds `*count` handles or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    out: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetGpuInstances", device, |_, gpu| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        if !mig_capable(gpu) || !gpu.mig {
            return NOT_SUPPORTED;
        }
        if by_id(profile_id).is_none() {
            return INVALID_ARGUMENT;
        }
        let found: Vec<nvmlGpuInstance_t> = instances(gpu)
            .into_iter()
            .filter(|i| i.profile.id == profile_id)
            .map(|i| instance_handle(gpu.index, i.id))
            .collect();
        let capacity = unsafe { *count } as usize;
        unsafe { *count = found.len() as c_uint };
        if found.is_empty() {
            return SUCCESS;
        }
        if out.is_null() || capacity < found.len() {
            return INSUFFICIENT_SIZE;
        }
        for (i, h) in found.into_iter().enumerate() {
            unsafe { *out.add(i) = h };
        }
        SUCCESS
    })
}

/// A GPU instance by id; `NOT_FOUND` for an id the GPU does not have.
///
/// # Safety
/// `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    out: *mut nvmlGpuInstance_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetGpuInstanceById", device, |_, gpu| {
        if out.is_null() {
            return INVALID_ARGUMENT;
        }
        if !mig_capable(gpu) || !gpu.mig {
            return NOT_SUPPORTED;
        }
        if instances(gpu).iter().any(|i| i.id == id) {
            unsafe { put(out, instance_handle(gpu.index, id)) }
        } else {
            NOT_FOUND
        }
    })
}

/// How many more instances of a profile fit in the memory slices the existing ones leave.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        device,
        |_, gpu| {
            if !mig_capable(gpu) || !gpu.mig {
                return NOT_SUPPORTED;
            }
            let Some(p) = by_id(profile_id) else {
                return NOT_SUPPORTED;
            };
            let existing = instances(gpu);
            let used: c_uint = existing.iter().map(|i| i.profile.memory_slices).sum();
            let same = existing.iter().filter(|i| i.profile.id == p.id).count() as c_uint;
            let fit =
                (8u32.saturating_sub(used) / p.memory_slices).min(p.instances.saturating_sub(same));
            unsafe { put(count, fit) }
        },
    )
}

/// A GPU instance's device, id, profile id and placement.
///
/// # Safety
/// `info` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> c_uint {
    let raw = instance as usize;
    let device = handle_of((raw & 0xff_ffff).wrapping_sub(1));
    let id = (raw >> 24).wrapping_sub(1) as c_uint;
    if instance.is_null() || info.is_null() || decode_handle(device).1.is_some() {
        return with_sim(|_| INVALID_ARGUMENT);
    }
    with_gpu(
        "nvmlGpuInstanceGetInfo",
        device,
        |_, gpu| match instances(gpu).into_iter().find(|i| i.id == id) {
            Some(i) => unsafe {
                put(
                    info,
                    nvmlGpuInstanceInfo_t {
                        device,
                        id,
                        profileId: i.profile.id,
                        placement: nvmlGpuInstancePlacement_t {
                            start: i.start,
                            size: i.profile.memory_slices,
                        },
                    },
                )
            },
            None => INVALID_ARGUMENT,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_follow_the_profile_sizes() {
        let starts = |id| {
            placements(by_id(id).unwrap())
                .iter()
                .map(|p| p.start)
                .collect::<Vec<_>>()
        };
        assert_eq!(starts(19), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(starts(15), [0, 2, 4, 6]);
        assert_eq!(starts(14), [0, 2, 4]);
        assert_eq!(starts(9), [0, 4]);
        assert_eq!(starts(0), [0]);
    }
}
