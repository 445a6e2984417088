//! Output buffers written first by the tasks that compute them: a serial `calloc`/memset of
//! a whole buffer before a parallel pass idles the other cores (and faults its pages in on
//! one thread). One place for the few `unsafe` steps this takes.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::parallel::multi_threaded;

/// A buffer of `len` elements, none initialised yet.
pub fn buffer<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut buf = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialisation, and the capacity is `len`.
    unsafe { buf.set_len(len) };
    buf
}

/// `part` with every element set to zero, as initialised values.
pub fn zeroed<T: Copy + Default>(part: &mut [MaybeUninit<T>]) -> &mut [T] {
    for x in part.iter_mut() {
        x.write(T::default());
    }
    // SAFETY: every element was just initialised; `MaybeUninit<T>` has `T`'s layout.
    unsafe { &mut *(part as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// `len` elements in rows of `width` (the last may be shorter), each zeroed and then filled
/// by `f(row index, row)` on the thread that computes it, in parallel when rayon has
/// several threads.
pub fn filled_rows<T: Copy + Default + Send>(
    len: usize,
    width: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = buffer(len);
    let fill = |(r, row): (usize, &mut [MaybeUninit<T>])| f(r, zeroed(row));
    if multi_threaded() {
        out.par_chunks_mut(width).enumerate().for_each(fill);
    } else {
        out.chunks_mut(width).enumerate().for_each(fill);
    }
    // SAFETY: the rows cover the buffer, and `zeroed` initialised each.
    unsafe { assume_init(out) }
}

/// `buf` as initialised values.
///
/// # Safety
/// Every element of `buf` has been written.
pub unsafe fn assume_init<T>(buf: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut buf = std::mem::ManuallyDrop::new(buf);
    // SAFETY: all elements are initialised (contract); `MaybeUninit<T>` has `T`'s layout,
    // and pointer, length and capacity come from one live `Vec`.
    unsafe { Vec::from_raw_parts(buf.as_mut_ptr().cast::<T>(), buf.len(), buf.capacity()) }
}

/// `buf` as initialised values, borrowed.
///
/// # Safety
/// Every element of `buf` has been written.
pub unsafe fn assume_init_ref<T>(buf: &[MaybeUninit<T>]) -> &[T] {
    // SAFETY: all elements are initialised (contract); same layout.
    unsafe { &*(buf as *const [MaybeUninit<T>] as *const [T]) }
}
