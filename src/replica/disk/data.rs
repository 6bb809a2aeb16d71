//! The data file: the bytes of one copy of the volume, below admission.
//!
//! [`DataFile`] is the only code that opens or touches `volume.img`. The
//! store above it ([`super::store`]) decides whether a request may change
//! the copy and in what order — the fence floor and its drain (S2, S3), the
//! S6 marks and the missed-write maps written before the data (S7), the
//! steps of a growth — and then calls through this one type for the I/O
//! itself. Nothing here knows of terms, marks or metadata. That is the
//! seam where another data layer (a snapshot layer, say) can slot in below
//! admission without admission changing, provided it keeps the same
//! promises:
//!
//! - **Durable on `sync`.** Every write or punch that returned before
//!   [`DataFile::sync`] began is on stable storage once `sync` returns; a
//!   write with `fua` is durable when it returns. [`DataFile::create`] and
//!   [`DataFile::grow`] return only once the file's new length is durable,
//!   so the store records a size only after the bytes behind it exist.
//! - **Holes read as zeroes.** A range never written, punched out by
//!   [`DataFile::punch`] or added by a growth reads back as zeroes.
//!   [`DataFile::is_hole`] and [`DataFile::allocation`] may report such a
//!   range without reading it, and never report a hole where data is: a
//!   file system that cannot say reports data. (The store's digests rely on
//!   this to skip holes.)
//! - **Any alignment in, aligned I/O out.** Callers read and write any byte
//!   range inside the file. A large write goes to the disk with `O_DIRECT`
//!   for its middle, in whole 2 MiB blocks ([`FOLIO_ALIGN`]) from memory
//!   aligned to 4 KiB ([`MEMORY_ALIGN`]), and through the page cache, in
//!   64 KiB pieces, for its ends and for everything else. Mixing the two is
//!   coherent only because no two writes that share a byte are in flight at
//!   once: the caller must see to that (the engine's stripes and write
//!   order, S11, do).
//! - **Blocking.** Every method blocks. The store runs them through
//!   [`run_io`], inline for small page-cache I/O and on the blocking pool
//!   otherwise, and moves its admission guard into the same closure, so a
//!   cancelled request keeps a fence out until its I/O has ended (S3).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::replica::ReplicaError;

/// The data file's name in the store's directory.
pub(super) const DATA_FILE: &str = "volume.img";

/// One copy's data file, as the store writes it (see the module docs for
/// what it promises).
pub(super) struct DataFile {
    file: File,
    /// The same file opened again with `O_DIRECT`, where the file system
    /// allows it: most of a large write goes through it (see [`DIRECT_IO`]).
    direct: Option<File>,
}

impl DataFile {
    /// Opens the data file of an existing copy in `dir`, whose recorded
    /// size is `size`. A file shorter than that is refused; a longer one is
    /// a growth that was cut off before it was recorded, and is kept as it
    /// is (the store serves only `size`, and the next growth zeroes the
    /// tail).
    pub(super) fn open(dir: &Path, size: u64) -> Result<Self, ReplicaError> {
        let data_path = dir.join(DATA_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&data_path)
            .map_err(|err| ReplicaError::Io(format!("opening {}: {err}", data_path.display())))?;
        let len = file.metadata()?.len();
        if len < size {
            return Err(ReplicaError::IdentityMismatch(format!(
                "{} is {len} bytes, the volume is {} bytes",
                data_path.display(),
                size
            )));
        }
        if len > size {
            // A growth that crashed before it was recorded. The
            // tail is kept, never served, and zeroed by the next
            // growth: opening a store never cuts its data file.
            tracing::warn!(
                file = %data_path.display(),
                len,
                size,
                "the data file is longer than the recorded size (a growth that \
                 was cut off); serving the recorded size"
            );
        }
        Ok(Self::with_direct(file, &data_path))
    }

    /// Creates the data file of a new copy in `dir`, sparse at `size`
    /// bytes, durably. A file already there is taken only if it is empty
    /// or already `size` bytes; any other is refused, untouched.
    pub(super) fn create(dir: &Path, size: u64) -> Result<Self, ReplicaError> {
        let data_path = dir.join(DATA_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&data_path)?;
        let len = file.metadata()?.len();
        if len != 0 && len != size {
            return Err(ReplicaError::IdentityMismatch(format!(
                "{} already exists with {len} bytes and no replica metadata; \
                 refusing to resize it to {}",
                data_path.display(),
                size
            )));
        }
        file.set_len(size)?;
        file.sync_all()?;
        Ok(Self::with_direct(file, &data_path))
    }

    fn with_direct(file: File, path: &Path) -> Self {
        Self {
            file,
            direct: open_direct(path),
        }
    }

    /// Writes `data` at `offset` (see [`write_data`]); with `fua`, it is
    /// durable when this returns.
    pub(super) fn write(&self, data: &[u8], offset: u64, fua: bool) -> std::io::Result<()> {
        write_data(&self.file, self.direct.as_ref(), data, offset)?;
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// Reads exactly `len` bytes at `offset` into a new buffer.
    pub(super) fn read(&self, len: usize, offset: u64) -> std::io::Result<Vec<u8>> {
        read_at(&self.file, len, offset)
    }

    /// Fills `buf` from the bytes at `offset`.
    pub(super) fn read_into(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Frees `[offset, offset + len)`, which reads as zeroes from then on
    /// (see [`punch_hole`]).
    pub(super) fn punch(&self, offset: u64, len: u64) -> std::io::Result<()> {
        punch_hole(&self.file, offset, len)
    }

    /// Makes every write and punch that returned before this call durable.
    pub(super) fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Grows the file from the served size `from` to `size`, durably (see
    /// [`extend_file`]).
    pub(super) fn grow(&self, from: u64, size: u64) -> std::io::Result<()> {
        extend_file(&self.file, from, size)
    }

    /// The data and hole runs of `[start, end)` (see [`allocation_of`]).
    pub(super) fn allocation(&self, start: u64, end: u64) -> Vec<crate::volume::Extent> {
        allocation_of(&self.file, start, end)
    }

    /// Whether `[start, end)` holds no data at all (see [`is_hole`]).
    pub(super) fn is_hole(&self, start: u64, end: u64) -> bool {
        is_hole(&self.file, start, end)
    }

    /// Whether large writes go direct (the file system took `O_DIRECT`).
    #[cfg(test)]
    pub(super) fn has_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The file, for tests that look past this layer (to drop its cache).
    #[cfg(test)]
    pub(super) fn file(&self) -> &File {
        &self.file
    }
}

/// The largest read, or write without FUA, that runs on the calling task's
/// thread. A 4 KiB write into the page cache takes a few µs; handing it to
/// the blocking pool and back costs two thread wake-ups, which perf showed
/// as most of a small replica write's CPU time.
pub(super) const INLINE_IO: usize = 64 * 1024;

/// Writes at least this long (a rebuild's runs of extents, a client's
/// large writes) bypass the page cache for their [`FOLIO_ALIGN`]ed middle.
/// Such data is streamed, not reread soon; through the cache it costs a
/// copy into newly allocated pages, which on a VM whose free memory went
/// back to the host costs several times the disk write (measured: a
/// buffered 1 GiB `dd` into a file took 0.8 s right after another and
/// 1.8–3.1 s after 5 s idle, an `O_DIRECT` one 0.58 s either way), and a
/// flush later writes it all back anyway.
pub(super) const DIRECT_IO: usize = 4 << 20;
/// What part of a large write goes direct: whole, aligned blocks of the
/// largest page-cache folio (2 MiB, a PMD, with 4 KiB pages). Folios are
/// aligned to their size, so no cached folio straddles the direct part's
/// ends: a cached write next to it (S11 lets writes that share no byte run
/// at once) can never dirty a folio the direct write must drop from the
/// cache, which the kernel could not do, leaving stale bytes cached.
const FOLIO_ALIGN: u64 = 2 << 20;
/// The largest piece a write hands the page cache at once. The kernel
/// gives a buffered write a folio as large as the write (up to 2 MiB), and
/// ext4 then walks every 4 KiB block of that folio on each later small
/// write into it. Measured on a 6.18 kernel, three replicas on one disk:
/// after 1 MiB sequential writes, random 4 KiB writes into the same range
/// ran at QD1 p50 194–208 µs and 13.5k IOPS at QD32, until the cache was
/// dropped; written in these pieces, 146 µs and 23–24k IOPS. It costs
/// large buffered writes a few more system calls (1 MiB writes at QD8:
/// about 5% less throughput).
const CACHED_PIECE: u64 = 64 * 1024;
/// The alignment of a direct write's memory: the largest logical block
/// size of a common disk.
pub(super) const MEMORY_ALIGN: usize = 4096;

/// The part of `[offset, offset + len)` that a write sends direct: its
/// whole [`FOLIO_ALIGN`]ed blocks, if it is large enough to bother.
fn direct_part(offset: u64, len: usize) -> Option<std::ops::Range<u64>> {
    let start = offset.checked_next_multiple_of(FOLIO_ALIGN)?;
    let end = offset.checked_add(len as u64)? / FOLIO_ALIGN * FOLIO_ALIGN;
    (len >= DIRECT_IO && end > start).then_some(start..end)
}

/// The data file opened for writing with `O_DIRECT`, or `None` where the
/// file system refuses it (then every write goes through the cache).
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
        .ok()
}

/// Writes `data` at `offset`: the [`direct_part`] of a large write
/// through `direct`, the rest (or all, if the direct write is refused as
/// misaligned) through the page cache of `file`.
///
/// Mixing the two on one file is coherent here: the kernel writes back
/// and drops the cached pages of a direct write's range around it, the
/// engine never lets two writes that share a byte overlap (its extent
/// stripes and S11), and no folio straddles the direct part's ends (see
/// [`FOLIO_ALIGN`]).
fn write_data(file: &File, direct: Option<&File>, data: &[u8], offset: u64) -> std::io::Result<()> {
    let (Some(direct), Some(part)) = (direct, direct_part(offset, data.len())) else {
        return write_cached(file, data, offset);
    };
    let (head, rest) = data.split_at((part.start - offset) as usize);
    let (middle, tail) = rest.split_at((part.end - part.start) as usize);
    write_cached(file, head, offset)?;
    let refused =
        |err: &std::io::Error| err.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error());
    // A payload the block channel received apart is aligned already (see
    // `crate::net::link::FrameReader`): written as it is, with no copy.
    if middle.as_ptr().align_offset(MEMORY_ALIGN) == 0 {
        match direct.write_all_at(middle, part.start) {
            Err(err) if refused(&err) => {
                tracing::debug!(%err, "a direct write was refused; writing through the cache");
                write_cached(file, middle, part.start)?;
            }
            done => done?,
        }
        return write_cached(file, tail, part.end);
    }
    // Otherwise through one aligned buffer of DIRECT_IO bytes, reused for
    // each piece of the middle: an aligned copy of the whole would double
    // the memory a large write holds (a full rebuild's target peaked at
    // 149-165 MiB that way, 125 MiB this way). Only its first bytes, up to
    // the alignment, are zeroed.
    let block = DIRECT_IO;
    let mut room: Vec<u8> = Vec::with_capacity(block + MEMORY_ALIGN);
    room.resize(room.as_ptr().align_offset(MEMORY_ALIGN), 0u8);
    let skip = room.len();
    let mut at = part.start;
    for piece in middle.chunks(block) {
        room.truncate(skip);
        room.extend_from_slice(piece);
        match direct.write_all_at(&room[skip..], at) {
            Err(err) if refused(&err) => {
                tracing::debug!(%err, "a direct write was refused; writing through the cache");
                let done = (at - part.start) as usize;
                write_cached(file, &middle[done..], at)?;
                break;
            }
            done => done?,
        }
        at += piece.len() as u64;
    }
    write_cached(file, tail, part.end)
}

/// Writes `data` at `offset` through the page cache in pieces that end on
/// [`CACHED_PIECE`] boundaries of the file.
fn write_cached(file: &File, data: &[u8], offset: u64) -> std::io::Result<()> {
    for piece in cached_pieces(offset, data.len()) {
        file.write_all_at(&data[piece.clone()], offset + piece.start as u64)?;
    }
    Ok(())
}

/// The pieces, as ranges of the data, in which [`write_cached`] writes
/// `len` bytes at `offset`: each ends on a [`CACHED_PIECE`] boundary of the
/// file or at the end of the data.
fn cached_pieces(offset: u64, len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut done = 0;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let at = offset + done as u64;
        let room = (CACHED_PIECE - at % CACHED_PIECE) as usize;
        let piece = done..done + room.min(len - done);
        done = piece.end;
        Some(piece)
    })
}

/// Reads exactly `len` bytes at `offset` into a new buffer, which it does
/// not zero first (zeroing 8 MiB costs as much as reading it from the
/// page cache).
fn read_at(file: &File, len: usize, offset: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len);
    while buf.len() < len {
        let at = offset + buf.len() as u64;
        match rustix::io::pread(file, rustix::buffer::spare_capacity(&mut buf), at) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(err) => return Err(err.into()),
        }
    }
    buf.truncate(len);
    Ok(buf)
}

/// Where a piece of file I/O runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunOn {
    /// On the calling task's thread: small I/O that the page cache serves.
    Caller,
    /// On the blocking pool: large I/O, syncs, punches, hashing.
    Pool,
}

impl RunOn {
    pub(super) fn for_write(len: usize, fua: bool) -> Self {
        if !fua && len <= INLINE_IO {
            Self::Caller
        } else {
            Self::Pool
        }
    }

    pub(super) fn for_read(len: u64) -> Self {
        if len <= INLINE_IO as u64 {
            Self::Caller
        } else {
            Self::Pool
        }
    }
}

/// Runs positioned file I/O where `on` says. Raft has a runtime of its
/// own (`raft::runtime`), so a small write that blocks a data-plane thread
/// briefly cannot delay a heartbeat.
pub(super) async fn run_io<T, F>(on: RunOn, io: F) -> Result<T, ReplicaError>
where
    T: Send + 'static,
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
{
    if on == RunOn::Caller {
        return io().map_err(ReplicaError::from);
    }
    tokio::task::spawn_blocking(io)
        .await
        .map_err(|err| ReplicaError::Io(format!("I/O task failed: {err}")))?
        .map_err(ReplicaError::from)
}

/// Extends the data file from the served size `from` to `size`, durably.
/// Cutting it to `from` first drops whatever tail an earlier, unfinished
/// growth left, so the new range reads as zeroes.
fn extend_file(file: &File, from: u64, size: u64) -> std::io::Result<()> {
    file.set_len(from)?;
    file.set_len(size)?;
    file.sync_all()
}

/// Frees `[offset, offset + len)` of `file`, keeping its size; where the file
/// system cannot punch holes, writes zeroes instead.
fn punch_hole(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    use rustix::fs::FallocateFlags;
    if len == 0 {
        return Ok(());
    }
    let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
    match rustix::fs::fallocate(file, flags, offset, len) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => {
            let zeroes = vec![0u8; len.min(1 << 20) as usize];
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(zeroes.len() as u64) as usize;
                file.write_all_at(&zeroes[..n], at)?;
                at += n as u64;
            }
            Ok(())
        }
        Err(err) => Err(err.into()),
    }
}

/// The data and hole runs of `[start, end)` of `file`, in order (see
/// [`super::store::ReplicaStore::allocation`]); adjacent runs alike are merged. Stops
/// after [`crate::volume::MAX_RUNS`] runs: the runs then cover a prefix.
fn allocation_of(file: &std::fs::File, start: u64, end: u64) -> Vec<crate::volume::Extent> {
    use rustix::fs::{SeekFrom, seek};
    fn push(runs: &mut Vec<crate::volume::Extent>, len: u64, hole: bool) {
        if len == 0 {
            return;
        }
        match runs.last_mut() {
            Some(last) if last.hole == hole => last.len += len,
            _ => runs.push(crate::volume::Extent { len, hole }),
        }
    }
    let mut runs: Vec<crate::volume::Extent> = Vec::new();
    let mut at = start;
    while at < end && (runs.len() as u64) < crate::volume::MAX_RUNS {
        let data = match seek(file, SeekFrom::Data(at)) {
            Ok(data) => data.clamp(at, end),
            // No data from `at` to the end of the file.
            Err(rustix::io::Errno::NXIO) => end,
            // The file system cannot say: all data.
            Err(_) => {
                push(&mut runs, end - at, false);
                break;
            }
        };
        push(&mut runs, data - at, true);
        if data >= end {
            break;
        }
        let hole = match seek(file, SeekFrom::Hole(data)) {
            Ok(hole) => hole.min(end),
            Err(_) => end,
        };
        // A hole at `data` would contradict SEEK_DATA; never loop in place.
        let hole = hole.max(data + 1).min(end);
        push(&mut runs, hole - data, false);
        at = hole;
    }
    runs
}

/// Whether `[start, end)` of `file` holds no data at all, so it reads as
/// zeroes: `SEEK_DATA` from `start` finds none before `end`. The kernel
/// counts written data still in the page cache (delayed allocation) as
/// data. Where the file system cannot say, the range holds data.
fn is_hole(file: &std::fs::File, start: u64, end: u64) -> bool {
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(start)) {
        Ok(next) => next >= end,
        // No data from `start` to the end of the file.
        Err(rustix::io::Errno::NXIO) => true,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs of data and holes, in order, merged, covering the range; a
    /// query that would return too many runs covers a prefix.
    #[test]
    fn allocation_runs_follow_the_file() {
        use crate::volume::Extent;
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        file.set_len(8 << 20).unwrap();
        file.write_all_at(&[7u8; 8192], 1 << 20).unwrap();
        let runs = allocation_of(&file, 0, 8 << 20);
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 8 << 20);
        assert_eq!(
            runs,
            [
                Extent {
                    len: 1 << 20,
                    hole: true
                },
                Extent {
                    len: 8192,
                    hole: false
                },
                Extent {
                    len: (7 << 20) - 8192,
                    hole: true
                },
            ]
        );
        // A range inside the data, and one inside a hole.
        assert_eq!(
            allocation_of(&file, (1 << 20) + 4096, (1 << 20) + 8192),
            [Extent {
                len: 4096,
                hole: false
            }]
        );
        assert_eq!(
            allocation_of(&file, 0, 4096),
            [Extent {
                len: 4096,
                hole: true
            }]
        );
    }

    #[test]
    fn a_cached_write_in_pieces_lands_whole_at_any_offset() {
        let dir = tempfile::tempdir().unwrap();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("data"))
            .unwrap();
        let piece = CACHED_PIECE as usize;
        // Within one piece, across one boundary, across many, from one.
        for (offset, len) in [
            (100, 10),
            (piece as u64 - 7, 20),
            (3, 5 * piece + 11),
            (0, 2 * piece),
        ] {
            // The pieces cover the data in order, none crosses a boundary.
            let mut next = 0;
            for cut in cached_pieces(offset, len) {
                assert_eq!(cut.start, next, "{len} bytes at {offset}: a gap or overlap");
                let (first, last) = (offset + cut.start as u64, offset + cut.end as u64 - 1);
                assert_eq!(
                    first / CACHED_PIECE,
                    last / CACHED_PIECE,
                    "{cut:?} crosses a boundary"
                );
                next = cut.end;
            }
            assert_eq!(next, len, "{len} bytes at {offset}: not all written");
            let data: Vec<u8> = (0..len).map(|i| (i * 31 + offset as usize) as u8).collect();
            write_cached(&file, &data, offset).unwrap();
            let mut got = vec![0u8; len];
            file.read_exact_at(&mut got, offset).unwrap();
            assert!(
                got == data,
                "{len} bytes at {offset}: not the bytes written"
            );
        }
        write_cached(&file, &[], 5).unwrap();
    }

    #[test]
    fn only_whole_folio_blocks_of_a_large_write_go_direct() {
        const MIB: u64 = 1 << 20;
        let big = DIRECT_IO;
        assert_eq!(direct_part(0, big), Some(0..4 * MIB));
        assert_eq!(direct_part(MIB, big), Some(2 * MIB..4 * MIB));
        assert_eq!(direct_part(MIB + 512, big), Some(2 * MIB..4 * MIB));
        assert_eq!(direct_part(MIB, 8 * MIB as usize), Some(2 * MIB..8 * MIB));
        assert_eq!(direct_part(0, big - 4096), None, "too short");
        // Any 4 MiB holds a whole aligned 2 MiB block.
        assert_eq!(direct_part(MIB + 1, big), Some(2 * MIB..4 * MIB));
        assert_eq!(direct_part(u64::MAX - 10, big), None, "no overflow");
    }
}
