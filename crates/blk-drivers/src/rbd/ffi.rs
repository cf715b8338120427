//! The part of librados' and librbd's C API (`rados/librados.h`, `rbd/librbd.h`, Ceph 16)
//! that the `rbd` driver calls, declared by hand: handles are opaque pointers, return values
//! are 0 or a negative errno. Linked by `build.rs` (`-lrbd -lrados`) only where it found
//! librbd, which is also what turns `cfg(blkq_rbd)` on.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};

/// `rados_t`: a cluster handle.
pub type rados_t = *mut c_void;
/// `rados_ioctx_t`: an I/O context (one pool).
pub type rados_ioctx_t = *mut c_void;
/// `rbd_image_t`: an open image.
pub type rbd_image_t = *mut c_void;
/// `rbd_completion_t`: an asynchronous request's completion.
pub type rbd_completion_t = *mut c_void;
/// `rbd_callback_t`: called once when a completion completes, on one of librbd's threads.
pub type rbd_callback_t = Option<unsafe extern "C" fn(cb: rbd_completion_t, arg: *mut c_void)>;
/// The callback of `rbd_diff_iterate2`: offset, length, whether the extent holds data, arg.
pub type rbd_diff_cb = Option<unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int>;

/// `EVENT_TYPE_EVENTFD`: `rbd_set_image_notification`'s fd is an eventfd.
pub const EVENT_TYPE_EVENTFD: c_int = 2;
/// `RBD_LOCK_MODE_EXCLUSIVE` of `rbd_lock_mode_t`.
pub const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
/// `RBD_FEATURE_EXCLUSIVE_LOCK` (`rbd/features.h`).
pub const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;
/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: the zeroed range stays allocated.
pub const RBD_WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;

const RBD_MAX_BLOCK_NAME_SIZE: usize = 24;
const RBD_MAX_IMAGE_NAME_SIZE: usize = 96;

/// `rbd_image_info_t`, filled by `rbd_stat`.
#[repr(C)]
pub struct rbd_image_info_t {
    /// Image size, bytes.
    pub size: u64,
    /// Object size, bytes.
    pub obj_size: u64,
    /// Number of objects.
    pub num_objs: u64,
    /// log2 of the object size.
    pub order: c_int,
    /// Deprecated.
    pub block_name_prefix: [c_char; RBD_MAX_BLOCK_NAME_SIZE],
    /// Deprecated.
    pub parent_pool: i64,
    /// Deprecated.
    pub parent_name: [c_char; RBD_MAX_IMAGE_NAME_SIZE],
}

#[link(name = "rados")]
extern "C" {
    pub fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;
    pub fn rbd_stat(image: rbd_image_t, info: *mut rbd_image_info_t, infosize: usize) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_lock_acquire(image: rbd_image_t, lock_mode: c_int) -> c_int;
    pub fn rbd_lock_get_owners(
        image: rbd_image_t,
        lock_mode: *mut c_int,
        lock_owners: *mut *mut c_char,
        max_lock_owners: *mut usize,
    ) -> c_int;
    pub fn rbd_lock_get_owners_cleanup(lock_owners: *mut *mut c_char, lock_owner_count: usize);
    pub fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: rbd_diff_cb,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    pub fn rbd_aio_get_arg(c: rbd_completion_t) -> *mut c_void;
    /// Since librbd 1.12 (Ceph 12): once set, completions created without a callback are
    /// queued for `rbd_poll_io_events` and the fd is signalled (an eventfd: written 1) as each
    /// one completes.
    pub fn rbd_set_image_notification(image: rbd_image_t, fd: c_int, type_: c_int) -> c_int;
    /// Takes up to `numcomp` completed callback-less completions into `comps`; returns how
    /// many (0: none queued), or a negative errno.
    pub fn rbd_poll_io_events(
        image: rbd_image_t,
        comps: *mut rbd_completion_t,
        numcomp: c_int,
    ) -> c_int;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_aio_read(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *mut c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_write(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *const c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
}
