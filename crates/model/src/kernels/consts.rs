//! Small constant tensors (codebooks, lookup tables, `arange`s, rotary frequencies) built once per
//! device and reused.
//!
//! Why: `Tensor::new(&table, &cuda)` is a host-to-device copy (a synchronizing `cuMemcpyHtoD`
//! of pageable memory) on every call. The NF4 dequantization, the 8-bit optimizer and the loss
//! ran one or more such uploads per layer per step; through [`cached`] each constant crosses to a
//! device once per process and later calls are a hash lookup and an `Arc` clone.
//!
//! The cache maps (device location, [`ConstKey`]) to a tensor and never evicts: its entries are
//! small (the largest are the 8-bit quantizer's bucket tables, a few MiB per map, see
//! `kernels::blockwise8`) and few (one per constant and device). A key names the constant and
//! carries the numbers it depends on (a vocabulary size, the bits of the rotary frequencies), so
//! two different constants never share an entry.
//!
//! Two `Device` handles for the same GPU (`Device::new_cuda(0)` called twice) are distinct
//! devices to Candle (ops between them fail); an entry is returned only when its tensor's device
//! is the same device (`Device::same_device`) as the caller's, and is replaced otherwise, so a
//! process that alternates handles rebuilds rather than mixes them.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::{Device, DeviceLocation, Tensor};

/// What a cached constant is: a name, plus the numbers it is a function of.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConstKey {
    name: &'static str,
    params: Vec<u64>,
}

impl ConstKey {
    /// A constant that depends on nothing but its name (a fixed codebook).
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            params: Vec::new(),
        }
    }

    /// A constant that depends on `params` too (a length, a flag, the bits of some floats).
    pub fn with(name: &'static str, params: impl IntoIterator<Item = u64>) -> Self {
        Self {
            name,
            params: params.into_iter().collect(),
        }
    }
}

type Cache = Mutex<HashMap<(DeviceLocation, ConstKey), Tensor>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The tensor for `key` on `device`: built by `make(device)` on the first call (per device),
/// the cached one (the same tensor: same id, same storage) afterwards.
///
/// `make` runs without the lock held (it may itself call [`cached`]); if two threads race, both
/// build and the first to insert wins, so every caller still gets one shared tensor from then on.
/// The returned tensor is shared: never write it in place.
pub fn cached(
    device: &Device,
    key: ConstKey,
    make: impl FnOnce(&Device) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    cached_at(device.location(), device, key, make)
}

/// [`cached`] with the location given (lets the tests put two locations in the cache on a
/// machine that has only a CPU).
fn cached_at(
    location: DeviceLocation,
    device: &Device,
    key: ConstKey,
    make: impl FnOnce(&Device) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    let slot = (location, key);
    {
        // A poisoned lock only means another thread panicked while holding it; the map itself
        // is always in a valid state (single inserts), so keep using it.
        let map = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = map.get(&slot) {
            if t.device().same_device(device) {
                return Ok(t.clone());
            }
        }
    }
    let t = make(device)?;
    let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
    let entry = map.entry(slot).or_insert_with(|| t.clone());
    if !entry.device().same_device(device) {
        *entry = t; // another handle's entry: this device's tensor replaces it
    }
    Ok(entry.clone())
}

/// Number of cached constants (all devices). For tests and diagnostics.
pub fn len() -> usize {
    cache().lock().unwrap_or_else(|e| e.into_inner()).len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use std::cell::Cell;

    fn ones(n: usize) -> impl FnOnce(&Device) -> candle_core::Result<Tensor> {
        move |d| Tensor::ones(n, DType::F32, d)
    }

    #[test]
    fn second_call_returns_the_cached_tensor() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let key = ConstKey::with("consts-test.same", [3]);
        let built = Cell::new(0);
        let make = |d: &Device| {
            built.set(built.get() + 1);
            Tensor::arange(0u32, 3, d)
        };
        let a = cached(&dev, key.clone(), make)?;
        let b = cached(&dev, key, |_| panic!("built twice"))?;
        assert_eq!(built.get(), 1);
        assert_eq!(a.id(), b.id(), "not the same tensor");
        // same storage, not an equal copy
        let (sa, _) = a.storage_and_layout();
        let (sb, _) = b.storage_and_layout();
        assert!(std::ptr::eq(&*sa, &*sb), "not the same storage");
        assert_eq!(b.to_vec1::<u32>()?, [0, 1, 2]);
        Ok(())
    }

    #[test]
    fn different_keys_and_locations_do_not_collide() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        // same name, different parameters; different names, same parameters
        let a = cached(&dev, ConstKey::with("consts-test.k", [4]), ones(4))?;
        let b = cached(&dev, ConstKey::with("consts-test.k", [5]), ones(5))?;
        let c = cached(&dev, ConstKey::with("consts-test.k2", [4]), ones(4))?;
        assert_ne!(a.id(), b.id());
        assert_ne!(a.id(), c.id());
        assert_eq!((a.dims1()?, b.dims1()?, c.dims1()?), (4, 5, 4));
        // the same key at two device locations: two entries
        let key = ConstKey::new("consts-test.loc");
        let cpu = cached_at(DeviceLocation::Cpu, &dev, key.clone(), ones(2))?;
        let on_gpu =
            |gpu_id, n| cached_at(DeviceLocation::Cuda { gpu_id }, &dev, key.clone(), ones(n));
        let (gpu, gpu1) = (on_gpu(0, 3)?, on_gpu(1, 6)?);
        assert_ne!(cpu.id(), gpu.id());
        assert_ne!(gpu.id(), gpu1.id());
        assert_eq!((cpu.dims1()?, gpu.dims1()?, gpu1.dims1()?), (2, 3, 6));
        // and each location keeps its own
        let again = cached_at(DeviceLocation::Cuda { gpu_id: 0 }, &dev, key, |_| {
            panic!("rebuilt")
        })?;
        assert_eq!(again.id(), gpu.id());
        assert!(len() >= 6);
        Ok(())
    }
}
