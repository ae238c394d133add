package io.edgebus.delta;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Iterator;
import java.util.List;
import java.util.NoSuchElementException;

import io.delta.storage.HDFSLogStore;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;

/**
 * Delta's log store for tables on a local (or mounted) file system, whose listing costs what it
 * returns rather than what the directory holds.
 *
 * <p>Before every commit and snapshot update Delta lists {@code _delta_log} from its newest
 * checkpoint ({@code listFrom}). Hadoop's local file system answers a listing with a status of
 * every entry in the directory, a few system calls each: some 17 microseconds an entry here, so
 * a commit's cost grew with the whole log (0.34 s at a hundred entries, 5.4 s at 300,000;
 * BENCHMARKS.md, bench.delta_log). This store reads the directory's names alone, keeps those
 * at or after the name asked for, and asks the status of each as the caller reaches it: the
 * same files in the same order as {@link HDFSLogStore}'s listing, which writes and reads
 * everything else unchanged. Other file systems get HDFSLogStore's own listing.
 */
public class LocalListingLogStore extends HDFSLogStore {

    public LocalListingLogStore(Configuration hadoopConf) {
        super(hadoopConf);
    }

    @Override
    public Iterator<FileStatus> listFrom(Path path, Configuration hadoopConf) throws IOException {
        FileSystem fs = path.getFileSystem(hadoopConf);
        RawLocalFileSystem raw = rawLocal(fs);
        if (raw == null) {
            return super.listFrom(path, hadoopConf);
        }
        Path parent = path.getParent();
        String[] names = raw.pathToFile(parent).list();
        if (names == null) {
            throw new FileNotFoundException(
                String.format("No such file or directory: %s", parent));
        }
        String first = path.getName();
        List<String> kept = new ArrayList<>();
        for (String name : names) {
            if (name.compareTo(first) >= 0) {
                kept.add(name);
            }
        }
        Collections.sort(kept);
        return new Statuses(fs, raw, parent, kept.iterator());
    }

    /**
     * The statuses of {@code names} in {@code parent}, each asked for when the iterator gets
     * to it: Delta's log cleanup lists the log from its first version and stops at the first
     * commit younger than its cutoff, so it pays for the files it deletes, not for the log.
     */
    private static final class Statuses implements Iterator<FileStatus> {
        private final FileSystem fs;
        private final RawLocalFileSystem raw;
        private final Path parent;
        private final Iterator<String> names;
        private FileStatus next;

        Statuses(FileSystem fs, RawLocalFileSystem raw, Path parent, Iterator<String> names) {
            this.fs = fs;
            this.raw = raw;
            this.parent = parent;
            this.names = names;
        }

        @Override
        public boolean hasNext() {
            while (next == null && names.hasNext()) {
                Path child = new Path(parent, names.next());
                if (fs != raw && ((LocalFileSystem) fs).isChecksumFile(child)) {
                    continue;  // what LocalFileSystem's own listing leaves out
                }
                try {
                    next = fs.getFileStatus(child);
                } catch (FileNotFoundException gone) {
                    // deleted since the names were read (the log's cleanup): not listed
                } catch (IOException failed) {
                    throw new UncheckedIOException(failed);
                }
            }
            return next != null;
        }

        @Override
        public FileStatus next() {
            if (!hasNext()) {
                throw new NoSuchElementException();
            }
            FileStatus found = next;
            next = null;
            return found;
        }
    }

    private static RawLocalFileSystem rawLocal(FileSystem fs) {
        if (fs instanceof RawLocalFileSystem) {
            return (RawLocalFileSystem) fs;
        }
        if (fs instanceof LocalFileSystem) {
            FileSystem inner = ((LocalFileSystem) fs).getRawFileSystem();
            return inner instanceof RawLocalFileSystem ? (RawLocalFileSystem) inner : null;
        }
        return null;
    }
}
