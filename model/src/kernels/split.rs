//! How the products and row-by-row work of a pass are split over the thread pool: products
//! in a few long contiguous parts per thread ([`for_parts`]), row-by-row work in ranges of
//! rows from [`PARALLEL_ROWS`] rows up ([`for_row_ranges`]), and the pointer the threads
//! write their disjoint parts of an output through ([`SendPtr`]).

/// An output pointer handed to pool threads that each write disjoint parts of it (kernels
/// write their own rows, attention its own (row, head) slices).
pub(crate) struct SendPtr<T = f32>(pub(crate) *mut T);
// Copied as a pointer whatever `T` is (a derive would ask `T: Copy`).
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }

    /// Elements `range` of the buffer this points into.
    ///
    /// # Safety
    /// The range must lie in the buffer, and no one else may use it while the slice lives.
    pub(crate) unsafe fn slice<'a>(self, range: std::ops::Range<usize>) -> &'a mut [T] {
        // SAFETY: as the caller guarantees.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(range.start), range.len()) }
    }
}

/// Rows a pass must have before its row-by-row work (norms, activation quantisation, rotary
/// embedding, SiLU) is spread over the thread pool. Each such call takes a few microseconds
/// at a few rows, about what a dispatch and the other threads' wake-up cost: at 8 rows on 2
/// threads (`specd bench engine --profile --profile-rows 8`) the phases took as long spread
/// as not, at 64 rows half as long (prompt chunks, large batches).
pub(crate) const PARALLEL_ROWS: usize = 16;

/// Runs `work` over rows `0..rows` in [`for_parts`]' contiguous ranges when there are at
/// least [`PARALLEL_ROWS`] rows; else on this thread. The ranges cover every row once, and
/// each row's work is the same however they are split.
pub(crate) fn for_row_ranges(rows: usize, work: impl Fn(std::ops::Range<usize>) + Sync) {
    if rows < PARALLEL_ROWS {
        work(0..rows);
        return;
    }
    for_parts(rows, work);
}

/// Contiguous parts per pool thread that a product's work items are split into.
const PARTS_PER_THREAD: usize = 1;

/// Runs `work` over items `0..items` in [`PARTS_PER_THREAD`] contiguous ranges per pool
/// thread. A product's items are ordered so that consecutive ones read consecutive weights,
/// and one long stream per core is what the memory system serves fastest: on 2 threads
/// passes took 6–15% less than with the pool's dynamic split (about 8 small grabs per
/// thread, which interleave the cores' streams; `docs/SCALING-RUNS.md`). Every item is
/// computed the same way whichever part holds it.
pub(crate) fn for_parts(items: usize, work: impl Fn(std::ops::Range<usize>) + Sync) {
    let pool = candle_core::utils::barrier_pool();
    let parts = ((pool.n_workers() + 1) * PARTS_PER_THREAD).min(items);
    if parts <= 1 {
        work(0..items);
        return;
    }
    pool.execute_chunked(parts, |range| {
        work(range.start * items / parts..range.end * items / parts);
    });
}

/// [`for_row_ranges`] over `out`, a buffer of rows of `width` values: `work` gets each range
/// of rows with those rows of `out`, and every row goes to exactly one call.
pub(crate) fn for_row_chunks<T: Send>(
    out: &mut [T],
    width: usize,
    work: impl Fn(std::ops::Range<usize>, &mut [T]) + Sync,
) {
    assert!(
        width > 0 && out.len().is_multiple_of(width),
        "rows of `width` values"
    );
    let ptr = SendPtr(out.as_mut_ptr());
    for_row_ranges(out.len() / width, |rows| {
        let values = rows.start * width..rows.end * width;
        // SAFETY: the ranges of rows are disjoint and each goes to one call; they lie in
        // `out` (checked above), which stays borrowed until every call has returned.
        work(rows, unsafe { ptr.slice(values) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_item_once_in_contiguous_ranges() {
        for items in [0usize, 1, 2, 3, 7, 100, 1537] {
            let seen = std::sync::Mutex::new(Vec::new());
            for_parts(items, |range| seen.lock().unwrap().push(range));
            let mut ranges = seen.into_inner().unwrap();
            ranges.sort_by_key(|r| r.start);
            let covered: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(
                covered,
                (0..items).collect::<Vec<_>>(),
                "{items} items: {ranges:?}"
            );
            let threads = candle_core::utils::barrier_pool().n_workers() + 1;
            assert!(
                ranges.len() <= (threads * PARTS_PER_THREAD).max(1),
                "{items} items: {ranges:?}"
            );
        }
    }
}
