//! Big-endian reading and writing over byte slices, without panics.

use crate::proto::NBD_MAX_STRING_LEN;
use crate::Error;

/// A cursor over an input slice. Every read is checked; a short read returns `None`.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let rest = self.buf;
        self.buf = &[];
        rest
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).and_then(|s| s.try_into().ok())
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }
}

/// A cursor over an output slice. Writes past the end are dropped and remembered, so that
/// `finish` reports them instead of panicking; encoders check the length up front anyway.
pub(crate) struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
    overflow: bool,
}

impl<'a> Writer<'a> {
    /// A writer over `buf`, which must hold `needed` bytes.
    pub(crate) fn new(buf: &'a mut [u8], needed: usize) -> Result<Self, Error> {
        if buf.len() < needed {
            return Err(Error::BufferTooSmall {
                needed,
                available: buf.len(),
            });
        }
        Ok(Self {
            buf,
            pos: 0,
            overflow: false,
        })
    }

    pub(crate) fn bytes(&mut self, src: &[u8]) {
        let end = self.pos.saturating_add(src.len());
        match self.buf.get_mut(self.pos..end) {
            Some(dst) => {
                dst.copy_from_slice(src);
                self.pos = end;
            }
            None => self.overflow = true,
        }
    }

    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes(&v.to_be_bytes());
    }

    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes(&v.to_be_bytes());
    }

    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes(&v.to_be_bytes());
    }

    /// The number of bytes written.
    pub(crate) fn finish(self) -> Result<usize, Error> {
        if self.overflow {
            return Err(Error::BufferTooSmall {
                needed: self.pos.saturating_add(1),
                available: self.buf.len(),
            });
        }
        Ok(self.pos)
    }
}

/// Appends exactly `len` bytes to `out` with `encode`, which writes into the new tail. On error
/// `out` is left as it was.
pub(crate) fn append(
    out: &mut Vec<u8>,
    len: usize,
    encode: impl FnOnce(&mut [u8]) -> Result<usize, Error>,
) -> Result<(), Error> {
    let start = out.len();
    out.resize(start + len, 0);
    match encode(&mut out[start..]) {
        Ok(n) if n == len => Ok(()),
        Ok(n) => {
            out.truncate(start);
            Err(Error::BufferTooSmall {
                needed: n,
                available: len,
            })
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Checks that `s` is acceptable as a protocol string: at most [`NBD_MAX_STRING_LEN`] bytes,
/// no NUL. (UTF-8 validity is guaranteed by the type.)
pub(crate) fn check_str(what: &'static str, s: &str) -> Result<(), Error> {
    if s.len() > NBD_MAX_STRING_LEN {
        return Err(Error::StringTooLong {
            what,
            length: s.len(),
        });
    }
    if s.as_bytes().contains(&0) {
        return Err(Error::InvalidString { what });
    }
    Ok(())
}

/// Parses a protocol string: at most [`NBD_MAX_STRING_LEN`] bytes, UTF-8, no NUL.
pub(crate) fn parse_str<'a>(what: &'static str, bytes: &'a [u8]) -> Result<&'a str, Error> {
    if bytes.len() > NBD_MAX_STRING_LEN {
        return Err(Error::StringTooLong {
            what,
            length: bytes.len(),
        });
    }
    let s = core::str::from_utf8(bytes).map_err(|_| Error::InvalidString { what })?;
    if bytes.contains(&0) {
        return Err(Error::InvalidString { what });
    }
    Ok(s)
}

/// `len` as a u32 wire field.
pub(crate) fn len_u32(field: &'static str, len: usize) -> Result<u32, Error> {
    u32::try_from(len).map_err(|_| Error::ValueTooLarge {
        field,
        value: len as u64,
        max: u64::from(u32::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_is_checked() {
        let mut r = Reader::new(&[0, 1, 2, 3, 4]);
        assert_eq!(r.u16(), Some(1));
        assert_eq!(r.u32(), None);
        assert_eq!(r.remaining(), 3);
        assert_eq!(r.take(2), Some(&[2u8, 3][..]));
        assert_eq!(r.u64(), None);
        assert_eq!(r.rest(), &[4]);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn writer_reports_overflow() {
        let mut buf = [0u8; 3];
        assert!(matches!(
            Writer::new(&mut buf, 4),
            Err(Error::BufferTooSmall {
                needed: 4,
                available: 3
            })
        ));
        let mut w = Writer::new(&mut buf, 2).unwrap();
        w.u16(0x0102);
        w.u16(0x0304);
        assert!(w.finish().is_err());
        assert_eq!(buf, [1, 2, 0]);
    }

    #[test]
    fn append_rolls_back() {
        let mut v = vec![9];
        let r = append(&mut v, 4, |_| Err(Error::InvalidString { what: "x" }));
        assert!(r.is_err());
        assert_eq!(v, [9]);
        append(&mut v, 2, |b| {
            let mut w = Writer::new(b, 2)?;
            w.u16(7);
            w.finish()
        })
        .unwrap();
        assert_eq!(v, [9, 0, 7]);
    }

    #[test]
    fn strings() {
        assert_eq!(parse_str("s", b"abc"), Ok("abc"));
        assert!(parse_str("s", b"a\0c").is_err());
        assert!(parse_str("s", &[0xff]).is_err());
        assert!(parse_str("s", &[b'a'; 4097]).is_err());
        assert!(parse_str("s", &[b'a'; 4096]).is_ok());
        assert!(check_str("s", "a\0").is_err());
        assert!(check_str("s", &"a".repeat(4097)).is_err());
        assert!(check_str("s", "").is_ok());
    }
}
