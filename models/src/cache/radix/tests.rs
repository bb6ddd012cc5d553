use candle_core::{DType, Device, Tensor};

use super::*;
use crate::cache::pool::{KvPool, PAGE_SIZE};

const P: usize = PAGE_SIZE;

fn pool(pages: usize) -> KvPool {
    KvPool::new(1, 1, 2, pages, DType::F32, &Device::Cpu).unwrap()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn features(rows: usize, base: f32) -> Tensor {
    let v: Vec<f32> = (0..rows * 3).map(|i| base + i as f32).collect();
    Tensor::from_vec(v, (rows, 3), &Device::Cpu).unwrap()
}

#[test]
fn full_pages_are_cached_and_found_up_to_the_limit() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(pool.clone(), usize::MAX);
    let t = tokens(1, 3 * P + 5);
    let table = pool.allocate(4).unwrap();
    // Only the full pages of the committed rows are cached.
    assert_eq!(cache.insert(&t, &table, 3 * P + 5, None).unwrap(), 3);
    assert_eq!(cache.cached_pages(), 3);
    let m = cache.lookup(&t, t.len(), false).unwrap();
    assert_eq!(m.pages, &table.pages()[..3]);
    assert_eq!(m.rows(), 3 * P);
    // A limit inside the third page stops before it.
    let m = cache.lookup(&t, 3 * P - 1, false).unwrap();
    assert_eq!(m.pages.len(), 2);
    // A prompt diverging inside page 2 shares pages 0 and 1 only.
    let mut other = t.clone();
    other[P + 7] = 7;
    assert_eq!(
        cache
            .lookup(&other, other.len(), false)
            .unwrap()
            .pages
            .len(),
        1
    );
    // Inserting the same tokens again adds nothing and keeps the first pages.
    let again = pool.allocate(3).unwrap();
    assert_eq!(cache.insert(&t, &again, 3 * P, None).unwrap(), 0);
    assert_eq!(
        cache.lookup(&t, t.len(), false).unwrap().pages,
        &table.pages()[..3]
    );
}

#[test]
fn cached_pages_outlive_their_sequence_and_are_evicted_least_recent_first() {
    let pool = pool(6);
    let mut cache = PrefixCache::new(pool.clone(), usize::MAX);
    let a = tokens(1, 2 * P);
    let b = tokens(2, 2 * P);
    let ta = pool.allocate(2).unwrap();
    let tb = pool.allocate(2).unwrap();
    cache.insert(&a, &ta, 2 * P, None).unwrap();
    cache.insert(&b, &tb, 2 * P, None).unwrap();
    assert_eq!(pool.free_pages(), 2);
    assert_eq!(
        cache.evictable_pages(),
        0,
        "both sequences still hold their pages"
    );
    assert_eq!(cache.evict(4), 0);
    drop(ta);
    drop(tb);
    assert_eq!(pool.free_pages(), 2, "the cache keeps the pages");
    assert_eq!(cache.evictable_pages(), 4);
    // `a` used last: `b`'s pages go first, leaf before parent.
    cache.lookup(&a, a.len(), false).unwrap();
    assert_eq!(cache.evict(1), 1);
    assert_eq!(cache.lookup(&b, b.len(), false).unwrap().pages.len(), 1);
    cache.lookup(&a, a.len(), false).unwrap();
    assert_eq!(cache.evict(1), 1);
    assert!(cache.lookup(&b, b.len(), false).unwrap().pages.is_empty());
    assert_eq!(cache.lookup(&a, a.len(), false).unwrap().pages.len(), 2);
    assert_eq!(pool.free_pages(), 4);
    // A sequence on a cached prefix holds it: its pages are not evictable.
    let m = cache.lookup(&a, a.len(), false).unwrap();
    let user = pool.allocate_after(&m.pages, 1).unwrap();
    assert_eq!(cache.evictable_pages(), 0);
    assert_eq!(cache.evict(8), 0);
    drop(user);
    cache.clear();
    assert_eq!(cache.cached_pages(), 0);
    assert_eq!(pool.free_pages(), 6, "every page is back");
}

#[test]
fn features_are_kept_per_page_and_bound_a_speculating_match() {
    let pool = pool(8);
    let mut cache = PrefixCache::new(pool.clone(), usize::MAX);
    let t = tokens(3, 3 * P);
    let plain = pool.allocate(3).unwrap();
    cache.insert(&t, &plain, 3 * P, None).unwrap();
    assert!(cache.lookup(&t, t.len(), true).unwrap().pages.is_empty());
    // A speculating sequence's prefill brings features for the first two pages' rows.
    let spec = pool.allocate(3).unwrap();
    let f = features(2 * P + 10, 0.5);
    assert_eq!(cache.insert(&t, &spec, 3 * P, Some(&f)).unwrap(), 0);
    let m = cache.lookup(&t, t.len(), true).unwrap();
    assert_eq!(m.pages, &plain.pages()[..2]);
    let got = m.features.unwrap();
    assert_eq!(got.dims(), &[2 * P, 3]);
    let want = f.narrow(0, 0, 2 * P).unwrap();
    let diff = (got - want).unwrap().abs().unwrap().sum_all().unwrap();
    assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(cache.feature_bytes(), 2 * P * 3 * 4);
    // A budget too small for a page keeps none.
    let mut small = PrefixCache::new(pool.clone(), P * 3 * 4 - 1);
    small.insert(&t, &spec, 3 * P, Some(&f)).unwrap();
    assert_eq!(small.feature_bytes(), 0);
    assert!(small.lookup(&t, t.len(), true).unwrap().pages.is_empty());
}

#[test]
fn tables_of_another_pool_are_refused() {
    let (p1, p2) = (pool(2), pool(2));
    let mut cache = PrefixCache::new(p1, usize::MAX);
    let t = p2.allocate(1).unwrap();
    assert!(cache.insert(&tokens(1, P), &t, P, None).is_err());
    assert!(cache
        .insert(&tokens(1, P), &PageTable::contiguous(), P, None)
        .is_err());
}
